"""Latency the gateway adds, against calling the engine directly, same run.

Requests alternate between the direct path and the gateway path so both see
the same machine state; reported are p50/p99 of each and of the difference.
Two request kinds: GET /v1/models (no model compute: pure proxy cost) and a
one-token completion (the whole request path).

    python benchmarks/serving/gateway_overhead.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.paths import RESULTS
from benchmarks.lib.percentiles import percentile
from llmserve.entrypoints.launcher import ServerProcess


async def timed(session, method, url, body=None) -> float:
    t0 = time.perf_counter()
    async with session.request(method, url, json=body) as r:
        await r.read()
        r.raise_for_status()
    return time.perf_counter() - t0


async def measure(engine_url, gateway_url, n):
    results = {}
    body = {"prompt": "hi", "max_tokens": 1, "temperature": 0}
    kinds = {"models": ("GET", "/v1/models", None), "completion": ("POST", "/v1/completions",
                                                                    body)}
    async with aiohttp.ClientSession() as s:
        for kind, (method, path, payload) in kinds.items():
            direct, via = [], []
            for _ in range(5):  # warm connections and caches
                await timed(s, method, engine_url + path, payload)
                await timed(s, method, gateway_url + path, payload)
            for _ in range(n):
                direct.append(await timed(s, method, engine_url + path, payload))
                via.append(await timed(s, method, gateway_url + path, payload))
            d, v = [1000 * t for t in direct], [1000 * t for t in via]
            results[kind] = {
                "direct_p50_ms": percentile(d, 50), "direct_p99_ms": percentile(d, 99),
                "gateway_p50_ms": percentile(v, 50), "gateway_p99_ms": percentile(v, 99),
                "added_p50_ms": percentile(v, 50) - percentile(d, 50),
                "added_p99_ms": percentile(v, 99) - percentile(d, 99)}
            r = results[kind]
            print(f"{kind:10} direct p50 {r['direct_p50_ms']:7.2f} ms p99 {r['direct_p99_ms']:7.2f}"
                  f" | gateway p50 {r['gateway_p50_ms']:7.2f} p99 {r['gateway_p99_ms']:7.2f}"
                  f" | added p50 {r['added_p50_ms']:6.2f} ms p99 {r['added_p99_ms']:6.2f} ms")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--json", default=str(RESULTS / "gateway_overhead.json"))
    args = ap.parse_args()
    engine = ServerProcess(["serve", "--model", args.model, "--log-level", "WARNING"],
                           "127.0.0.1", stdout=subprocess.DEVNULL)
    gateway = ServerProcess(["gateway", "--backend", engine.url, "--log-level", "WARNING"],
                            "127.0.0.1", stdout=subprocess.DEVNULL)
    try:
        report = asyncio.run(measure(engine.url, gateway.url, args.requests))
    finally:
        gateway.stop()
        engine.stop()
    Path(args.json).parent.mkdir(exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
