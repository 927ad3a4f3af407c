"""Prefill/decode disaggregation, engine side: the lease table, the import into the
block manager, the side channel, and real prefill and decode engines against a
colocated one (float32, so outputs must be equal token for token)."""

from __future__ import annotations

import time

import openai
import pytest
import torch

from llmserve.core.block_manager import BlockManager, prefix_hashes
from llmserve.distributed.kv_transfer.leases import LeaseError, LeaseTable
from llmserve.distributed.kv_transfer.params import (
    RemoteDecode,
    RemotePrefill,
    parse_kv_transfer_params,
)
from llmserve.distributed.kv_transfer.side_channel import SideChannelServer, read_remote_blocks
from llmserve.distributed.kv_transfer.transport import KVLayout, KVTransferError, TcpTransport
from llmserve.utils import free_port
from tests.server_proc import ServerProcess, scrape

SECRET = "pd-test-secret"


# --- kv_transfer_params ---------------------------------------------------------------------
def remote_params(**over) -> dict:
    base = dict(do_remote_prefill=True, remote_engine_id="e", remote_host="127.0.0.1",
                remote_port=5600, remote_lease_id="l", remote_block_ids=[1, 2],
                num_tokens=32, expires_at=time.time() + 30, model="m")
    return {**base, **over}


def test_params_parse_both_legs_and_refuse_malformed_fields():
    assert parse_kv_transfer_params(None) is None
    assert parse_kv_transfer_params({}) is None
    assert isinstance(parse_kv_transfer_params({"do_remote_decode": True}), RemoteDecode)
    remote = parse_kv_transfer_params(remote_params())
    assert isinstance(remote, RemotePrefill) and remote.remote_block_ids == [1, 2]
    assert parse_kv_transfer_params(remote.to_json()) == remote  # the answer round-trips
    for field, value in [("remote_port", "5600"), ("remote_port", 70000),
                         ("remote_block_ids", [1, -2]), ("remote_block_ids", [True]),
                         ("num_tokens", -1), ("remote_lease_id", None), ("model", 3)]:
        with pytest.raises(ValueError, match=field):
            parse_kv_transfer_params(remote_params(**{field: value}))
    with pytest.raises(ValueError, match="object"):
        parse_kv_transfer_params([1])
    with pytest.raises(ValueError, match="do_remote_decode"):
        parse_kv_transfer_params({"do_remote_decode": "yes"})


# --- leases ---------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lease_is_not_collected_while_read_and_expires_unread():
    clock = Clock()
    table = LeaseTable(ttl=30, clock=clock)
    read = table.create([3, 4], "d1")
    unread = table.create([5], "d2")
    table.begin_read(read.lease_id, "d1", 1, 1)
    clock.now += 31  # both past their deadline; one is being read
    assert [lease.lease_id for lease in table.collect()] == [unread.lease_id]
    assert table.expired_total == 1 and table.blocks_held == 2
    with pytest.raises(LeaseError) as e:  # a new read of an expired lease is refused
        table.begin_read(read.lease_id, "d1", 0, 1)
    assert e.value.reason == "expired"
    table.end_read(read.lease_id, release=True)
    assert [lease.lease_id for lease in table.collect()] == [read.lease_id]
    assert table.expired_total == 1  # released by its reader, not expired
    assert table.blocks_held == 0 and len(table) == 0


def test_lease_refuses_another_prompt_and_positions_it_does_not_cover():
    table = LeaseTable(ttl=30)
    lease = table.create([3, 4], "digest")
    for digest, first, count in [("other", 0, 1), ("digest", 1, 2), ("digest", -1, 1)]:
        with pytest.raises(LeaseError) as e:
            table.begin_read(lease.lease_id, digest, first, count)
        assert e.value.reason == "mismatch"
    assert table.release(lease.lease_id) and table.collect()
    assert not table.release("no-such-lease")


# --- the decode side's import into the block manager ---------------------------------------
def test_import_holds_the_cached_prefix_fills_the_rest_and_frees_everything():
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    tokens = list(range(20))
    hashes = prefix_hashes(tokens, 4, 4)
    held, first_new = bm.reserve_import(hashes)
    assert first_new == 0 and len(held) == 4 and bm.num_free_blocks == 4
    held = bm.commit_import(held, hashes, first_new, filled=True)
    assert [bm.cached[h] for h in hashes] == held  # the prefix cache finds them
    bm.unhold(held)
    # A second import of a longer prompt holds the 4 cached blocks, fills 2 new.
    hashes6 = prefix_hashes(tokens + list(range(100, 108)), 6, 4)
    held6, first_new6 = bm.reserve_import(hashes6)
    assert first_new6 == 4 and held6[:4] == held
    # A failed transfer gives the fresh blocks back and keeps only the cached prefix.
    kept = bm.commit_import(held6, hashes6, first_new6, filled=False)
    assert kept == held and hashes6[4] not in bm.cached
    bm.unhold(kept)
    bm.check_all_free()


def test_import_takes_only_what_fits_above_the_watermark():
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0.2)  # keeps 2 free
    held, first_new = bm.reserve_import(prefix_hashes(list(range(40)), 10, 4))
    assert first_new == 0 and len(held) == 8
    bm.unhold(held)
    bm.check_all_free()


# --- the side channel, in process -----------------------------------------------------------
LAYOUT = KVLayout("m", "float32", "none", num_layers=2, block_size=4, num_kv_heads=2,
                  head_dim=8)


def storage(fill: bool) -> torch.Tensor:
    shape = (2, 2, 12, 4, 2, 8)
    return torch.randn(shape) if fill else torch.zeros(shape)


@pytest.fixture()
def side_channel():
    src = storage(fill=True)
    leases = LeaseTable(ttl=30)
    transport = TcpTransport()
    transport.register(src)
    sent = []
    server = SideChannelServer(transport, leases, LAYOUT, "engine-a", SECRET.encode(),
                               on_sent=sent.append)
    port = server.start("127.0.0.1", 0)
    yield src, leases, port, sent
    server.close()


def lease_params(lease, port: int, num_tokens: int) -> RemotePrefill:
    return RemotePrefill("engine-a", "127.0.0.1", port, lease.lease_id, lease.block_ids,
                         num_tokens, lease.expires_at, "m")


def reader() -> TcpTransport:
    t = TcpTransport()
    t.register(storage(fill=False))
    return t


def test_side_channel_moves_exactly_the_leased_blocks_and_releases(side_channel):
    src, leases, port, sent = side_channel
    lease = leases.create([7, 2, 9], "d")
    dst = reader()
    moved = read_remote_blocks(dst, LAYOUT, lease_params(lease, port, 12), 1, [0, 5],
                               "d", SECRET.encode())
    assert moved == 2 * src[:, :, 0].numel() * 4
    assert torch.equal(dst.storage[:, :, 0], src[:, :, 2])
    assert torch.equal(dst.storage[:, :, 5], src[:, :, 9])
    assert dst.storage[:, :, [1, 2, 3, 4]].abs().sum() == 0  # nothing else written
    # The server counts and releases just after the last byte: give its thread a moment.
    deadline = time.monotonic() + 5
    while not (sent and len(leases.collect()) == 0 and len(leases) == 0) and \
            time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent == [2]
    assert len(leases) == 0  # read = released and collected


@pytest.mark.parametrize("case, reason", [
    ("wrong secret", "auth"), ("another prompt", "mismatch"), ("released lease", "expired"),
    ("another layout", "mismatch"), ("another engine", "mismatch"),
    ("nobody listening", "unreachable")])
def test_side_channel_refusals_name_their_reason(side_channel, case, reason):
    src, leases, port, sent = side_channel
    lease = leases.create([1, 2], "d")
    params, digest, secret, layout = lease_params(lease, port, 8), "d", SECRET.encode(), LAYOUT
    if case == "wrong secret":
        secret = b"guess"
    elif case == "another prompt":
        digest = "x"
    elif case == "released lease":
        leases.release(lease.lease_id)
    elif case == "another layout":
        layout = KVLayout("m", "bfloat16", "none", 2, 4, 2, 8)
    elif case == "another engine":
        params = RemotePrefill("engine-b", *list(params.to_json().values())[1:8])
    elif case == "nobody listening":
        params = RemotePrefill("engine-a", "127.0.0.1", free_port(),
                               *list(params.to_json().values())[3:8])
    with pytest.raises(KVTransferError) as e:
        read_remote_blocks(reader(), layout, params, 0, [0, 1], digest, secret)
    assert e.value.reason == reason
    assert sent == []


# --- real engines ---------------------------------------------------------------------------
COMMON = ["--dtype", "float32", "--kv-transfer-backend", "tcp"]  # nixl: test_kv_transport.py


@pytest.fixture(scope="module")
def engines(tiny_models):
    model = str(tiny_models["llama"])
    env = {"LLMSERVE_KV_TRANSFER_SECRET": SECRET}
    procs = {}
    try:
        procs["prefill"] = ServerProcess(model, "127.0.0.2", COMMON + [
            "--kv-role", "prefill", "--kv-transfer-port", "0"], env=env)
        procs["decode"] = ServerProcess(model, "127.0.0.3", COMMON + ["--kv-role", "decode"],
                                        env=env)
        procs["colocated"] = ServerProcess(model, "127.0.0.4", COMMON)
        yield {name: p.url for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def leg1(url: str, **body) -> dict:
    """Prefill only; the lease the prefill engine answers with."""
    resp = client(url).completions.create(
        model=None, **{**body, "max_tokens": 1},
        extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    return resp.model_extra["kv_transfer_params"]


def metric(url: str, name: str, **labels) -> float:
    series = scrape(url)
    if not labels:
        return series.get(name, 0.0)
    return sum(v for k, v in series.items() if k.startswith(name + "{")
               and all(f'{lk}="{lv}"' in k for lk, lv in labels.items()))


LONG = "In the beginning the model read a long prompt about foxes and dogs. " * 12


def test_greedy_output_equals_colocated_and_usage_counts_the_prompt_once(engines):
    body = dict(prompt=LONG, max_tokens=24, temperature=0)
    sent0 = metric(engines["prefill"], "llmserve:kv_transfer_tokens_total", direction="sent")
    params = leg1(engines["prefill"], **body)
    assert params["do_remote_prefill"] and params["num_tokens"] % 16 == 0
    assert len(params["remote_block_ids"]) == params["num_tokens"] // 16 > 5
    got = client(engines["decode"]).completions.create(
        model=None, **body, extra_body={"kv_transfer_params": params})
    want = client(engines["colocated"]).completions.create(model=None, **body)
    assert got.choices[0].text == want.choices[0].text
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == 24
    sent = metric(engines["prefill"], "llmserve:kv_transfer_tokens_total", direction="sent")
    assert sent - sent0 == params["num_tokens"]


def test_streamed_chat_with_seeded_sampling_equals_colocated(engines):
    messages = [{"role": "user", "content": LONG + " Tell me a story."}]
    body = dict(messages=messages, max_tokens=20, temperature=0.9, seed=11)
    first = client(engines["prefill"]).chat.completions.create(
        model=None, **{**body, "max_tokens": 1},
        extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    params = first.model_extra["kv_transfer_params"]
    stream = client(engines["decode"]).chat.completions.create(
        model=None, **body, stream=True, extra_body={"kv_transfer_params": params})
    got = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    want = client(engines["colocated"]).chat.completions.create(model=None, **body)
    assert got == want.choices[0].message.content and got


def test_a_second_turn_moves_only_the_new_blocks(engines):
    turn1 = LONG + " First question about the fox?"
    params = leg1(engines["prefill"], prompt=turn1)
    client(engines["decode"]).completions.create(
        model=None, prompt=turn1, max_tokens=2, temperature=0,
        extra_body={"kv_transfer_params": params})
    received0 = metric(engines["decode"], "llmserve:kv_transfer_tokens_total",
                       direction="received")
    turn2 = turn1 + " The fox ran away. " * 6 + " Second question?"
    params2 = leg1(engines["prefill"], prompt=turn2)
    got = client(engines["decode"]).completions.create(
        model=None, prompt=turn2, max_tokens=12, temperature=0,
        extra_body={"kv_transfer_params": params2})
    moved = metric(engines["decode"], "llmserve:kv_transfer_tokens_total",
                   direction="received") - received0
    assert 0 < moved <= params2["num_tokens"] - params["num_tokens"]
    want = client(engines["colocated"]).completions.create(
        model=None, prompt=turn2, max_tokens=12, temperature=0)
    assert got.choices[0].text == want.choices[0].text


def resign(params: dict) -> dict:
    """``params`` signed again with the deployment's secret (as a prefill engine would
    have): the test's way to name an engine that is dead or serves another model."""
    remote = parse_kv_transfer_params(params)
    return remote.signed(SECRET.encode()).to_json()


@pytest.mark.parametrize("fault, reason", [("dead engine", "unreachable"),
                                           ("another model", "mismatch"),
                                           ("forged params", "auth")])
def test_a_failed_transfer_prefills_locally(engines, fault, reason):
    prompt = LONG + f" A question about {fault}?"
    held = leg1(engines["prefill"], prompt=prompt)
    params = dict(held)
    if fault == "dead engine":
        params = resign({**params, "remote_port": free_port()})
    elif fault == "another model":
        params = resign({**params, "model": "another-model"})
    else:  # a client pointing the decode engine at a listener of its own
        params["remote_host"] = "127.0.0.9"
    failures0 = metric(engines["decode"], "llmserve:kv_transfer_failures_total", reason=reason)
    got = client(engines["decode"]).completions.create(
        model=None, prompt=prompt, max_tokens=10, temperature=0,
        extra_body={"kv_transfer_params": params})
    want = client(engines["colocated"]).completions.create(
        model=None, prompt=prompt, max_tokens=10, temperature=0)
    assert got.choices[0].text == want.choices[0].text
    assert metric(engines["decode"], "llmserve:kv_transfer_failures_total",
                  reason=reason) == failures0 + 1
    # Nobody read the lease: release it as a decode engine would, so the pool is whole
    # for the last test without waiting out the lease.
    release = RemotePrefill(**{k: v for k, v in held.items()
                               if k not in ("do_remote_prefill", "do_remote_decode")})
    layout = KVLayout(held["model"], "float32", "none", num_layers=2, block_size=16,
                      num_kv_heads=2, head_dim=16)  # the tiny checkpoint's
    assert read_remote_blocks(reader(), layout, release, 0, [], "", SECRET.encode()) == 0


def test_malformed_params_are_a_400_naming_the_field(engines):
    for params in ({"do_remote_prefill": True, "remote_port": "x"}, "not an object"):
        with pytest.raises(openai.BadRequestError) as e:
            client(engines["decode"]).completions.create(
                model=None, prompt="hi", max_tokens=2,
                extra_body={"kv_transfer_params": params})
        assert e.value.body["param"] == "kv_transfer_params"


def test_an_unread_lease_expires_and_frees_its_blocks(tiny_models):
    """A decode engine that dies (or a client that leaves) after leg 1: the lease
    expires, its blocks come back, and a late leg 2 still succeeds by prefilling."""
    # A 5 s lease: long enough that the scrapes just after leg 1 still see it held on a
    # loaded CI core (with 1 s, the lease had once expired before the first scrape).
    prefill = ServerProcess(str(tiny_models["llama"]), "127.0.0.5", COMMON + [
        "--kv-role", "prefill", "--kv-transfer-port", "0", "--kv-lease-ttl", "5"])
    try:
        params = leg1(prefill.url, prompt=LONG)
        assert metric(prefill.url, "llmserve:kv_transfer_blocks_held") == len(
            params["remote_block_ids"])
        assert metric(prefill.url, "vllm:kv_cache_usage_perc") > 0
        deadline = time.monotonic() + 30
        while metric(prefill.url, "llmserve:kv_transfer_blocks_held") and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric(prefill.url, "llmserve:kv_transfer_blocks_held") == 0
        assert metric(prefill.url, "vllm:kv_cache_usage_perc") == 0
        assert metric(prefill.url, "llmserve:kv_transfer_failures_total",
                      reason="expired") == 1
    finally:
        prefill.stop()


def test_a_prefill_engine_dying_mid_transfer_leaves_the_decode_engine_whole(engines):
    """A peer that passes the hello and starts sending blocks, then dies: the decode
    engine gives the half-filled blocks back, prefills itself and answers as a
    colocated engine would; nothing stays held."""
    import hashlib
    import hmac
    import socket
    import threading

    from llmserve.distributed.kv_transfer.side_channel import recv_message, send_message

    prompt = "Who dies mid-transfer? " + LONG  # nothing of it is cached on the decode side
    params = leg1(engines["prefill"], prompt=prompt)
    real_layout = KVLayout(params["model"], "float32", "none", 2, 16, 2, 16)
    listener = socket.create_server(("127.0.0.1", 0))

    def half_a_peer():  # a real peer (it holds the secret) that dies while sending
        conn, _ = listener.accept()
        with conn:
            send_message(conn, {"nonce": "n", "engine_id": "dying",
                                "layout": real_layout.to_json(), "transport": {}})
            theirs = recv_message(conn)["nonce"]
            send_message(conn, {"proof": hmac.new(SECRET.encode(), f"server|{theirs}|n".encode(),
                                                  hashlib.sha256).hexdigest()})
            recv_message(conn)  # the reader's proof
            send_message(conn, {"ok": True})
            read = recv_message(conn)
            send_message(conn, {"ok": True, "block_ids": list(range(read["count"]))})
            conn.sendall(b"\0" * 1000)  # far less than one block

    threading.Thread(target=half_a_peer, daemon=True).start()
    dying = resign({**params, "remote_engine_id": "dying", "remote_host": "127.0.0.1",
                    "remote_port": listener.getsockname()[1]})
    failures0 = metric(engines["decode"], "llmserve:kv_transfer_failures_total",
                       reason="protocol")
    got = client(engines["decode"]).completions.create(
        model=None, prompt=prompt, max_tokens=10, temperature=0,
        extra_body={"kv_transfer_params": dying})
    listener.close()
    want = client(engines["colocated"]).completions.create(
        model=None, prompt=prompt, max_tokens=10, temperature=0)
    assert got.choices[0].text == want.choices[0].text
    assert metric(engines["decode"], "llmserve:kv_transfer_failures_total",
                  reason="protocol") == failures0 + 1
    deadline = time.monotonic() + 5
    while metric(engines["decode"], "vllm:kv_cache_usage_perc") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(engines["decode"], "vllm:kv_cache_usage_perc") == 0
    release = RemotePrefill(**{k: v for k, v in params.items()
                               if k not in ("do_remote_prefill", "do_remote_decode")})
    assert read_remote_blocks(reader(), real_layout, release, 0, [], "", SECRET.encode()) == 0


def test_both_pools_are_whole_afterwards(engines):
    """Runs after the others in this module: every lease was read (or released) and
    every request finished, so no block is held anywhere."""
    deadline = time.monotonic() + 10
    while metric(engines["prefill"], "llmserve:kv_transfer_blocks_held") and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    for name in ("prefill", "decode"):
        assert metric(engines[name], "vllm:kv_cache_usage_perc") == 0, name
    assert metric(engines["prefill"], "llmserve:kv_transfer_blocks_held") == 0
