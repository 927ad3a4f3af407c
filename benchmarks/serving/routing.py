"""Routing policies compared on one multi-tenant workload, same run.

Three engines behind the gateway; many tenants, each with its own long system
prompt, send chat requests in random order. The engines' KV caches can each hold
about a third of all system prompts, so where a tenant's requests land decides
whether they hit the prefix cache. For each policy (prefix-hash, round-robin,
least-load) the gateway is restarted in front of the same engines with fresh
tenants; reported: the engines' prefix-cache hit rate (tokens) and TTFT.

    python benchmarks/serving/routing.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
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

WORDS = ("cache block token engine model gateway stream batch prefix kernel "
         "scheduler router policy tenant system prompt latency queue").split()


def tenants(rng, n, words):
    return [f"Tenant {t} rules: " + " ".join(rng.choice(WORDS) for _ in range(words))
            for t in range(n)]


async def one(session, url, model, system, question) -> float:
    body = {"model": model, "max_tokens": 4, "temperature": 0, "stream": True,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}
    t0 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for arrived, event in EventStream(r):
            # the first event with text: not the role's, whose content is ""
            if not any(c.get("delta", {}).get("content") == "" for c in event.get("choices", ())):
                return arrived - t0
    return time.perf_counter() - t0


async def workload(url, model, prompts, per_tenant, concurrency, rng):
    jobs = [(s, f"question {i}: {rng.random()}") for s in prompts for i in range(per_tenant)]
    rng.shuffle(jobs)
    sem = asyncio.Semaphore(concurrency)

    async def limited(session, job):
        async with sem:
            return await one(session, url, model, *job)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        return await asyncio.gather(*(limited(s, j) for j in jobs))


def counters(engines):
    m = [scrape_metrics(e.url) for e in engines]
    return (sum(x.get("vllm:prefix_cache_hits_total", 0) for x in m),
            sum(x.get("vllm:prefix_cache_queries_total", 0) for x in m))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--tenants", type=int, default=12)
    ap.add_argument("--system-words", type=int, default=400)
    ap.add_argument("--requests-per-tenant", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--kv-blocks", type=int, default=240,
                    help="KV blocks per engine (16 tokens each)")
    ap.add_argument("--policies", nargs="+", default=["prefix-hash", "round-robin", "least-load"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(RESULTS / "routing.json"))
    args = ap.parse_args()
    from llmserve.model_executor.model_loader.sources import load_config, resolve_model
    from llmserve.worker.kv_sizing import kv_block_bytes
    kv = args.kv_blocks * kv_block_bytes(load_config(resolve_model(args.model)), 16, 4)
    engines = [ServerProcess(["serve", "--model", args.model, "--kv-cache-memory", str(kv),
                              "--num-threads", "1", "--log-level", "WARNING"],
                             f"127.0.0.{41 + i}", stdout=subprocess.DEVNULL)
               for i in range(args.engines)]
    rng = random.Random(args.seed)
    report = {}
    try:
        for policy in args.policies:
            gw = ServerProcess(["gateway", "--policy", policy, "--log-level", "WARNING",
                                *sum((["--backend", e.url] for e in engines), [])],
                               "127.0.0.40", stdout=subprocess.DEVNULL)
            try:
                before = counters(engines)
                prompts = tenants(rng, args.tenants, args.system_words)
                ttfts = asyncio.run(workload(gw.url, args.model, prompts,
                                             args.requests_per_tenant, args.concurrency, rng))
                after = counters(engines)
            finally:
                gw.stop()
            hit_rate = (after[0] - before[0]) / max(after[1] - before[1], 1)
            t = np.array(ttfts) * 1000
            report[policy] = {"hit_rate": hit_rate, "ttft_mean_ms": float(t.mean()),
                              "ttft_p99_ms": percentile(t, 99)}
            print(f"{policy:12} prefix-cache hit rate {hit_rate:5.2f}   TTFT mean "
                  f"{t.mean():8.0f} ms   p99 {percentile(t, 99):8.0f} ms", flush=True)
    finally:
        for e in engines:
            e.stop()
    Path(args.json).parent.mkdir(exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
