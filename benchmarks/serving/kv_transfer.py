"""Moving one long prompt's KV between two engine processes (P/D), one run.

The KV of a 4,000-token prompt of the built-in model's shape (30 layers, 3 KV heads,
head_dim 64, 16-token blocks, bf16: 250 blocks, ~92 MB) is read from a "prefill"
process (its storage, lease table and side channel, as in an engine) into this one:

- ``nixl``: a one-sided NIXL READ (UCX) of the registered storage,
- ``tcp``: the blocks inline on the side channel (gathered, sent, scattered),
- ``baseline``: a plain loopback socket copy of the same bytes, contiguous buffer to
  contiguous buffer: what any copy through the kernel costs.

All three run in turn in every round (each against its own prefill process), so a
busy machine slows them alike. The transports are timed over the whole read (connect,
authenticate, read, release), as a decode engine does it. Where the prompt's blocks lie
in both pools (``--layout``): ``scattered`` (one block at a time, a long-running
engine's worst case), ``runs`` (runs of 8 consecutive blocks), ``contiguous``. NIXL
moves one descriptor per (layer, K/V, run of blocks). Torch runs one thread per side.

    python benchmarks/serving/kv_transfer.py [--layout scattered|runs|contiguous] [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import socket
import statistics
import sys
import time

import torch

from llmserve.distributed.kv_transfer.leases import LeaseTable
from llmserve.distributed.kv_transfer.params import RemotePrefill
from llmserve.distributed.kv_transfer.side_channel import SideChannelServer, read_remote_blocks
from llmserve.distributed.kv_transfer.transport import (
    KVLayout,
    make_transport,
    recv_exactly,
)

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16  # smollm2-135m-instruct
SECRET = b"bench"


def layout() -> KVLayout:
    return KVLayout("smollm2-135m-instruct", "bfloat16", "none", LAYERS, BLOCK, KV_HEADS,
                    HEAD_DIM)


def make_storage(num_blocks: int, fill: bool) -> torch.Tensor:
    shape = (LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    if not fill:
        return torch.zeros(shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def _prefill(conn, transport_name: str, num_blocks: int) -> None:
    """The prefill engine's side: a side channel over its storage, leases on demand;
    and the baseline's sender."""
    torch.set_num_threads(1)
    storage = make_storage(num_blocks, fill=True)
    transport = make_transport(transport_name)
    transport.register(storage)
    leases = LeaseTable(ttl=60)
    server = SideChannelServer(transport, leases, layout(), "prefill", SECRET)
    conn.send((server.start("127.0.0.1", 0), transport.name))
    while True:
        cmd, *args = conn.recv()
        if cmd == "lease":
            lease = leases.create(args[0], "d")
            conn.send((lease.lease_id, lease.expires_at))
            leases.collect()
        elif cmd == "baseline":  # send nbytes on a fresh loopback connection
            port, nbytes = args
            buf = memoryview(storage.view(torch.uint8).numpy().reshape(-1))[:nbytes]
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(buf)
            conn.send("sent")
        else:
            server.close()
            return


class Prefill:
    def __init__(self, transport_name: str, num_blocks: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_prefill, args=(child, transport_name, num_blocks),
                                daemon=True)
        self.proc.start()
        self.port, self.transport = self.conn.recv()

    def lease(self, block_ids: list[int]) -> RemotePrefill:
        self.conn.send(("lease", block_ids))
        lease_id, expires_at = self.conn.recv()
        return RemotePrefill("prefill", "127.0.0.1", self.port, lease_id, block_ids,
                             len(block_ids) * BLOCK, expires_at, layout().model)

    def stop(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(10)


class Reader:
    """The decode engine's side of one transport, with its own prefill process."""

    def __init__(self, name: str, args, src_ids: list[int], dst_ids: list[int]):
        self.name, self.src_ids, self.dst_ids = name, src_ids, dst_ids
        self.prefill = Prefill(name, args.blocks)
        self.dst = make_transport(name)
        assert self.dst.name == name, f"{name} does not load here"
        self.dst.register(make_storage(args.blocks, fill=False))

    def once(self) -> tuple[float, int]:
        remote = self.prefill.lease(self.src_ids)
        t0 = time.perf_counter()
        nbytes = read_remote_blocks(self.dst, layout(), remote, 0, self.dst_ids,
                                    "d", SECRET, timeout=60)
        return time.perf_counter() - t0, nbytes

    def check(self, args) -> None:
        want = make_storage(args.blocks, fill=True)
        src, dst = torch.tensor(self.src_ids), torch.tensor(self.dst_ids)
        assert torch.equal(self.dst.storage[:, :, dst], want[:, :, src]), "blocks differ"


class Baseline:
    """A plain loopback socket copy of ``nbytes``, contiguous to contiguous."""

    def __init__(self, args, nbytes: int):
        self.prefill = Prefill("tcp", args.blocks)
        self.buf = bytearray(nbytes)
        self.listener = socket.create_server(("127.0.0.1", 0))

    def once(self) -> tuple[float, int]:
        self.prefill.conn.send(("baseline", self.listener.getsockname()[1], len(self.buf)))
        sock, _ = self.listener.accept()
        with sock:
            t0 = time.perf_counter()
            recv_exactly(sock, memoryview(self.buf))
            dt = time.perf_counter() - t0
        self.prefill.conn.recv()
        return dt, len(self.buf)


def summary(result: dict, tokens: int, base: dict | None) -> dict:
    med = statistics.median(result["seconds"])
    out = {"GB/s": result["bytes"] / med / 1e9, "ms": med * 1e3,
           "ms per 1k tokens": med * 1e3 / (tokens / 1000),
           "min ms": min(result["seconds"]) * 1e3, "max ms": max(result["seconds"]) * 1e3}
    if base is not None:
        out["x baseline (GB/s)"] = out["GB/s"] / base["GB/s"]
        # Each round's contenders ran back to back: the ratio within a round is what a
        # machine whose load drifts between rounds still measures fairly.
        out["x baseline (paired)"] = statistics.median(
            b / t for b, t in zip(base["seconds"], result["seconds"]))
    else:
        out["x baseline (GB/s)"] = out["x baseline (paired)"] = 1.0
    out["seconds"] = result["seconds"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layout", choices=("scattered", "runs", "contiguous"),
                    default="scattered")
    ap.add_argument("--transports", default="nixl,tcp")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = args.tokens // BLOCK  # the prompt's full blocks
    args.blocks = n + n // 4 + 8  # each pool holds a little more than the prompt
    rng = random.Random(0)
    if args.layout == "scattered":
        src_ids, dst_ids = rng.sample(range(args.blocks), n), rng.sample(range(args.blocks), n)
    elif args.layout == "runs":
        def runs() -> list[int]:
            chunks = [list(range(b, b + 8)) for b in range(0, args.blocks - 7, 8)]
            rng.shuffle(chunks)
            return [b for chunk in chunks for b in chunk][:n]
        src_ids, dst_ids = runs(), runs()
    else:
        src_ids, dst_ids = list(range(n)), list(range(8, 8 + n))
    block_bytes = LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 2
    tokens = n * BLOCK
    print(f"{tokens} tokens = {n} blocks x {block_bytes} B = {n * block_bytes / 1e6:.1f} MB, "
          f"{args.layout} blocks, {args.rounds} rounds (median)", flush=True)
    # Round-robin, so a busy machine slows every contender alike.
    contenders = {"baseline": Baseline(args, n * block_bytes)}
    try:
        for name in args.transports.split(","):
            contenders[name] = Reader(name, args, src_ids, dst_ids)
        runs = {name: {"bytes": 0, "seconds": []} for name in contenders}
        for i in range(args.warmup + args.rounds):
            for name, c in contenders.items():
                dt, runs[name]["bytes"] = c.once()
                if i >= args.warmup:
                    runs[name]["seconds"].append(dt)
        for c in contenders.values():
            if isinstance(c, Reader):
                c.check(args)
    finally:
        for c in contenders.values():
            c.prefill.stop()
    base = summary(runs["baseline"], tokens, None)
    results = {name: summary(r, tokens, base if name != "baseline" else None)
               for name, r in runs.items()}
    print(f"{'':10} {'GB/s':>7} {'ms':>8} {'ms/1k tok':>10} {'x baseline':>11} "
          f"{'(paired)':>9}")
    for name, r in results.items():
        print(f"{name:10} {r['GB/s']:7.2f} {r['ms']:8.1f} {r['ms per 1k tokens']:10.2f} "
              f"{r['x baseline (GB/s)']:10.2f}x {r['x baseline (paired)']:8.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args) | {"argv": sys.argv}, "results": results}, f,
                      indent=1, default=str)


if __name__ == "__main__":
    main()
