"""KV transports across two real processes: the prefill side (its storage, lease table
and side channel) runs in a spawned subprocess, so NIXL's UCX does a real cross-process
READ; the decode side reads here. Every case runs for ``tcp`` and ``nixl`` (and the two
mixed pairs); then two real ``llmserve serve`` engines moving KV by NIXL."""

from __future__ import annotations

import multiprocessing as mp
import time

import openai
import pytest
import torch

from llmserve.distributed.kv_transfer import nixl as nixl_mod
from llmserve.distributed.kv_transfer.backends import make_transport
from llmserve.distributed.kv_transfer.params import RemotePrefill
from llmserve.distributed.kv_transfer.side_channel import read_remote_blocks
from llmserve.distributed.kv_transfer.transport import (
    KVLayout,
    KVTransferError,
    TcpTransport,
)
from tests.server_proc import ServerProcess, scrape

SECRET = b"kv-transport-secret"
SHAPE = (3, 2, 24, 4, 2, 8)  # layers, K/V, blocks, block_size, kv_heads, head_dim
LAYOUT = KVLayout("m", "float32", "none", SHAPE[0], SHAPE[3], SHAPE[4], SHAPE[5])


def _nixl_loads() -> str | None:
    """None when NIXL loads here, else why not."""
    try:
        nixl_mod.NixlTransport()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


NIXL_MISSING = _nixl_loads()
needs_nixl = pytest.mark.skipif(NIXL_MISSING is not None,
                                reason=f"NIXL does not load here: {NIXL_MISSING}")
TRANSPORTS = ["tcp", pytest.param("nixl", marks=needs_nixl)]


def source_storage() -> torch.Tensor:
    """The prefill side's KV: every element distinct, computable in both processes."""
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE) + 0.5


# --- the prefill side, in a spawned process -------------------------------------------------
def _prefill_main(conn, transport_name: str) -> None:
    from llmserve.distributed.kv_transfer.leases import LeaseTable
    from llmserve.distributed.kv_transfer.side_channel import SideChannelServer

    storage = source_storage()
    transport = make_transport(transport_name)
    transport.register(storage)
    leases = LeaseTable(ttl=30)
    sent: list[int] = []
    server = SideChannelServer(transport, leases, LAYOUT, "engine-p", SECRET,
                               on_sent=sent.append)
    port = server.start("127.0.0.1", 0)
    conn.send((port, transport.name))
    while True:
        cmd, *args = conn.recv()
        if cmd == "lease":
            block_ids, digest, ttl = args
            leases.ttl = ttl
            lease = leases.create(block_ids, digest)
            conn.send((lease.lease_id, lease.expires_at))
        elif cmd == "state":  # collect what may be freed; what is still held, what was sent
            leases.collect()
            conn.send((len(leases), list(sent)))
        else:
            server.close()
            conn.send("bye")
            return


class Prefill:
    def __init__(self, transport_name: str):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_prefill_main, args=(child, transport_name),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError("the prefill process did not start")
        self.port, self.transport = self.conn.recv()

    def lease(self, block_ids: list[int], digest: str = "d", ttl: float = 30.0) -> RemotePrefill:
        self.conn.send(("lease", block_ids, digest, ttl))
        lease_id, expires_at = self.conn.recv()
        return RemotePrefill("engine-p", "127.0.0.1", self.port, lease_id, block_ids,
                             len(block_ids) * SHAPE[3], expires_at, "m")

    def state(self, settled=lambda held, sent: True, wait: float = 5.0):
        deadline = time.monotonic() + wait
        while True:
            self.conn.send(("state",))
            held, sent = self.conn.recv()
            if settled(held, sent) or time.monotonic() > deadline:
                return held, sent
            time.sleep(0.02)

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
            self.conn.poll(10)
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


@pytest.fixture(scope="module", params=TRANSPORTS)
def prefill(request):
    p = Prefill(request.param)
    assert p.transport == request.param
    yield p
    p.stop()


READER_BLOCKS = SHAPE[2] + 6  # the decode engine's pool is another size


def reader(name: str):
    transport = make_transport(name)
    transport.register(torch.zeros(SHAPE[:2] + (READER_BLOCKS,) + SHAPE[3:]))
    return transport


# --- moving blocks --------------------------------------------------------------------------
@pytest.mark.parametrize("reader_name", TRANSPORTS)
def test_blocks_read_equal_the_source_and_the_lease_is_released(prefill, reader_name):
    src_ids = [3, 4, 5, 9, 1, 23, 0]  # runs and gaps, out of order, the last block
    dst_ids = [0, 1, 2, 7, 8, 28, 29]
    dst = reader(reader_name)
    held0, _ = prefill.state()
    remote = prefill.lease([*src_ids, 11])
    moved = read_remote_blocks(dst, LAYOUT, remote, 0, dst_ids, "d", SECRET,
                               timeout=20)
    region = SHAPE[3] * SHAPE[4] * SHAPE[5] * 4
    assert moved == len(src_ids) * SHAPE[0] * SHAPE[1] * region
    want = source_storage()
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(dst.storage[:, :, d], want[:, :, s]), (s, d)
    untouched = [b for b in range(READER_BLOCKS) if b not in dst_ids]
    assert dst.storage[:, :, untouched].abs().sum() == 0  # nothing else written
    held, sent = prefill.state(lambda held, sent: held == held0 and sent)
    assert held == held0 and sent[-1] == len(src_ids)  # released, collected, counted


@pytest.mark.parametrize("reader_name", TRANSPORTS)
def test_concurrent_reads_through_one_transport(prefill, reader_name):
    """A decode engine imports several requests' prefixes at once (one thread each)."""
    from concurrent.futures import ThreadPoolExecutor

    dst = reader(reader_name)
    jobs = [([4 * i, 4 * i + 1, 4 * i + 2], [6 * i + 5, 6 * i + 3, 6 * i + 4])
            for i in range(4)]
    remotes = [prefill.lease(src) for src, _ in jobs]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda job: read_remote_blocks(dst, LAYOUT, job[1], 0, job[0][1], "d",
                                                     SECRET, timeout=20),
                      [((src, d), remote) for (src, d), remote in zip(jobs, remotes)]))
    want = source_storage()
    for src, d in jobs:
        for s, t in zip(src, d):
            assert torch.equal(dst.storage[:, :, t], want[:, :, s]), (s, t)


@pytest.mark.parametrize("reader_name", TRANSPORTS)
def test_a_wrong_secret_is_refused_as_auth(prefill, reader_name):
    remote = prefill.lease([1, 2])
    with pytest.raises(KVTransferError) as e:
        read_remote_blocks(reader(reader_name), LAYOUT, remote, 0, [0, 1], "d",
                           b"guess", timeout=20)
    assert e.value.reason == "auth"


@pytest.mark.parametrize("reader_name", TRANSPORTS)
def test_an_expired_lease_is_refused_as_expired(prefill, reader_name):
    remote = prefill.lease([1, 2], ttl=0.2)
    time.sleep(0.4)
    # Past its expiry the reader does not even dial; with the peer's clock ahead of ours
    # (expires_at still in the future here) the prefill engine refuses it.
    for expires_at in (remote.expires_at, time.time() + 30):
        late = RemotePrefill(*list(remote.to_json().values())[:6], expires_at, "m")
        with pytest.raises(KVTransferError) as e:
            read_remote_blocks(reader(reader_name), LAYOUT, late, 0, [0, 1], "d",
                               SECRET, timeout=20)
        assert e.value.reason == "expired"


@needs_nixl
@pytest.mark.parametrize("prefill", ["nixl"], indirect=True)
@pytest.mark.parametrize("fault, reason", [("the READ hangs", "timeout"),
                                           ("NIXL raises", "unreachable")])
def test_a_failed_nixl_read_fails_both_sides_and_frees_the_lease(prefill, monkeypatch,
                                                                 fault, reason):
    dst = reader("nixl")
    if fault == "the READ hangs":
        monkeypatch.setattr(nixl_mod, "_poll", lambda agent, handle, state, deadline: "PROC")
    else:
        def broken(*args, **kwargs):
            raise RuntimeError("NIXL_ERR_BACKEND")
        monkeypatch.setattr(dst.agent, "initialize_xfer", broken)
    held0, sent0 = prefill.state()
    remote = prefill.lease([5, 6])
    with pytest.raises(KVTransferError) as e:
        read_remote_blocks(dst, LAYOUT, remote, 0, [0, 1], "d", SECRET, timeout=2)
    assert e.value.reason == reason
    held, sent = prefill.state(lambda held, sent: held == held0)
    assert held == held0 and sent == sent0  # released, not counted as sent


# --- choosing a transport -------------------------------------------------------------------
@needs_nixl
def test_auto_picks_nixl_where_it_loads():
    assert make_transport("auto").name == "nixl"
    assert make_transport("nixl").name == "nixl"
    assert make_transport("tcp").name == "tcp"


@pytest.mark.parametrize("failure", [ImportError("no module named nixl_cu12"),
                                     OSError("libucp.so: cannot open shared object"),
                                     RuntimeError("No plugins available for NIXL")])
def test_auto_falls_back_to_tcp_when_nixl_cannot_load(monkeypatch, caplog, failure):
    def broken():
        raise failure
    monkeypatch.setattr(nixl_mod, "load_nixl", broken)
    caplog.set_level("WARNING")
    transport = make_transport("auto")
    assert isinstance(transport, TcpTransport)
    assert str(failure) in caplog.text
    with pytest.raises(type(failure)):
        make_transport("nixl")
    with pytest.raises(ValueError):
        make_transport("rdma")


# --- real engines ---------------------------------------------------------------------------
COMMON = ["--dtype", "float32"]
PROMPT = "In the beginning the model read a long prompt about foxes and dogs. " * 12


@needs_nixl
def test_two_engines_move_kv_by_nixl_and_decode_as_a_colocated_engine(tmp_path_factory):
    from llmserve.model_executor.model_loader.sources import resolve_model
    from tests.conftest import write_tiny_checkpoint

    model = str(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama",
                                      resolve_model("smollm2-135m-instruct")))
    env = {"LLMSERVE_KV_TRANSFER_SECRET": SECRET.decode()}
    pd = COMMON + ["--kv-transfer-backend", "nixl"]
    procs = []
    try:
        procs.append(ServerProcess(model, "127.0.0.2", pd + [
            "--kv-role", "prefill", "--kv-transfer-port", "0"], env=env))
        procs.append(ServerProcess(model, "127.0.0.3", pd + ["--kv-role", "decode"], env=env))
        procs.append(ServerProcess(model, "127.0.0.4", COMMON))
        prefill, decode, colocated = (p.url for p in procs)
        body = dict(prompt=PROMPT, max_tokens=16, temperature=0)
        leg1 = client(prefill).completions.create(
            model=None, **{**body, "max_tokens": 1},
            extra_body={"kv_transfer_params": {"do_remote_decode": True}})
        params = leg1.model_extra["kv_transfer_params"]
        assert len(params["remote_block_ids"]) > 5
        got = client(decode).completions.create(model=None, **body,
                                                extra_body={"kv_transfer_params": params})
        want = client(colocated).completions.create(model=None, **body)
        assert got.choices[0].text == want.choices[0].text
        received = metric(decode, "llmserve:kv_transfer_tokens_total", direction="received")
        assert received == params["num_tokens"]
        assert metric(prefill, "llmserve:kv_transfer_tokens_total",
                      direction="sent") == params["num_tokens"]
        assert metric(decode, "llmserve:kv_transfer_failures_total") == 0
    finally:
        for p in procs:
            p.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def metric(url: str, name: str, **labels) -> float:
    return sum(v for k, v in scrape(url).items()
               if (k == name or k.startswith(name + "{"))
               and all(f'{lk}="{lv}"' in k for lk, lv in labels.items()))


@pytest.mark.parametrize("tls, only", [("", False), ("sm", True), ("sm,self", True),
                                       ("cma,self,sm", True), ("tcp,sm", False),
                                       ("rc_x,sm", False), ("^ib", False), ("all", False)])
def test_shared_memory_only_ucx_transports_turn_peer_error_handling_off(tls, only):
    assert nixl_mod._shared_memory_only(tls) is only
