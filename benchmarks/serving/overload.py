"""Overload without collapse: one engine offered several times what it can serve, with
and without the overload bounds (--max-waiting, --max-queue-delay), same run.

A burst of --burst streamed requests arrives at once at an engine with
--max-num-seqs slots. Unbounded, every request queues and the last ones wait for
all the others; bounded, the engine refuses what it cannot start soon (503
server_overloaded with Retry-After) and the requests it accepts keep a bounded
time to first token. Reported per configuration: accepted, refused (by reason),
p50/p99/max TTFT of the accepted, the most requests seen waiting, and whether the
engine ended idle.

    python benchmarks/serving/overload.py --burst 96 --max-num-seqs 8 --max-waiting 8 \\
        --max-queue-delay 5
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
import numpy as np

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.paths import RESULTS
from benchmarks.lib.percentiles import percentile
from benchmarks.lib.sse import EventStream
from llmserve.entrypoints.launcher import ServerProcess, scrape_metrics


async def one(session, url, i, max_tokens) -> dict:
    body = {"prompt": f"overload {i}: tell me a story", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            err = (await r.json())["error"]
            return {"status": r.status, "type": err["type"],
                    "reason": "queue_delay" if "max_queue_delay" in err["message"]
                    else "queue_full", "retry_after": r.headers.get("Retry-After"),
                    "answered_s": time.perf_counter() - t0}
        ttft = None
        async for arrived, _ in EventStream(r):
            if ttft is None:
                ttft = arrived - t0
        return {"status": 200, "ttft": ttft, "e2e": time.perf_counter() - t0}


async def burst(url, n, max_tokens) -> tuple[list[dict], float]:
    peak = 0.0
    done = asyncio.Event()

    async def watch():
        nonlocal peak
        while not done.is_set():
            m = await asyncio.to_thread(scrape_metrics, url)
            peak = max(peak, m["vllm:num_requests_waiting"])
            await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch())
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        results = await asyncio.gather(*(one(s, url, i, max_tokens) for i in range(n)))
    done.set()
    await watcher
    return results, peak


def summarize(results, peak, url) -> dict:
    ok = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] != 200]
    ttft = np.array([r["ttft"] for r in ok]) * 1000 if ok else np.array([0.0])
    reasons: dict[str, int] = {}
    for r in refused:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    time.sleep(1.0)
    m = scrape_metrics(url)
    return {"accepted": len(ok), "refused": len(refused), "refused_by_reason": reasons,
            "retry_after": sorted({r["retry_after"] for r in refused}),
            "refused_answered_p99_ms": round(percentile(
                [r["answered_s"] * 1000 for r in refused], 99), 1) if refused else None,
            "ttft_p50_ms": round(percentile(ttft, 50), 1),
            "ttft_p99_ms": round(percentile(ttft, 99), 1),
            "ttft_max_ms": round(float(ttft.max()), 1),
            "peak_waiting": peak,
            "idle_after": m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--burst", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-waiting", type=int, default=8)
    ap.add_argument("--max-queue-delay", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "overload.json")
    args = ap.parse_args()
    configs = {"unbounded": [],
               "bounded": ["--max-waiting", str(args.max_waiting),
                           "--max-queue-delay", str(args.max_queue_delay)]}
    out = {}
    for name, extra in configs.items():
        engine = ServerProcess(["serve", "--model", args.model, "--log-level", "WARNING",
                                "--max-num-seqs", str(args.max_num_seqs), *extra],
                               "127.0.0.70", stdout=subprocess.DEVNULL)
        try:
            asyncio.run(burst(engine.url, 4, 4))  # warm
            results, peak = asyncio.run(burst(engine.url, args.burst, args.max_tokens))
            out[name] = summarize(results, peak, engine.url)
        finally:
            engine.stop()
        print(name, json.dumps(out[name]), flush=True)
    out["config"] = vars(args) | {"out": str(args.out)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
