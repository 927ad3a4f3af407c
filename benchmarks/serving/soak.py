"""Soak: many streamed requests through the gateway over several engines, with a share
of clients walking away at random points; then check that nothing was lost or leaked.

Mixed requests: chat and completions, n = 1 or 2, some with stop strings, some with
logprobs, all streamed. A chosen share of clients disconnect, half of them before
the first byte (often before the gateway has even picked an engine) and half
mid-stream after a random number of events. Reported: completed, failed by cause
(among clients that stayed), disconnected, p50/p99 TTFT and ITL, and after the run
every engine's running/waiting requests and KV usage against its idle value (any
leaked block keeps the usage above it), and the RSS of every engine and the gateway
after a warm-up, at each quarter of the run and at the end (growth that flattens in
the second half is caches and first-touched KV pages; growth that keeps on is a leak).

    python benchmarks/serving/soak.py         # 1,000 requests, 30% disconnect, 3 engines
    python benchmarks/serving/soak.py --requests 200 --model /path/to/checkpoint --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.paths import RESULTS
from benchmarks.lib.percentiles import percentile
from benchmarks.lib.sse import EventStream
from llmserve.entrypoints.launcher import ServerProcess, scrape_metrics

WORDS = ("alpha beta gamma delta kernel cache block router engine stream token batch "
         "prefix queue swap paged attention decode prefill").split()


@dataclass
class Outcome:
    kind: str  # completed | failed | disconnected
    cause: str = ""
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    events: int = 0


def make_request(rng: random.Random, i: int, model: str | None,
                 max_tokens: int = 48) -> tuple[str, dict]:
    """One request of the mix: (path, body)."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
    body: dict = {"max_tokens": rng.randint(min(8, max_tokens), max_tokens), "stream": True,
                  "n": rng.choice((1, 1, 1, 2)), "temperature": rng.choice((0.0, 0.8)),
                  "seed": i}
    if model:
        body["model"] = model
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(WORDS), "\n\n"]
    chat = rng.random() < 0.5
    if rng.random() < 0.3:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    if rng.random() < 0.2:
        body["stream_options"] = {"include_usage": True}
    if chat:
        return "/v1/chat/completions", {**body, "messages": [
            {"role": "system", "content": f"soak tenant {i % 7}"},
            {"role": "user", "content": text}]}
    return "/v1/completions", {**body, "prompt": f"soak {i % 7}: {text}"}


async def one(session: aiohttp.ClientSession, url: str, path: str, body: dict,
              leave: str | None, leave_after: int) -> Outcome:
    """Send one request; ``leave``: None (stay to the end), "before" (go away before
    the first byte), "mid" (go away after ``leave_after`` events)."""
    t0 = time.perf_counter()
    out = Outcome("completed")
    last = None
    try:
        async with session.post(url + path, json=body) as r:
            if r.status != 200:
                return Outcome("failed", f"HTTP {r.status}")
            stream = EventStream(r)
            async for now, event in stream:
                if "error" in event:
                    return Outcome("failed", f"error event {event['error'].get('code')}")
                if out.ttft is None:
                    out.ttft = now - t0
                elif last is not None:
                    out.itls.append(now - last)
                last = now
                out.events += 1
                if leave == "mid" and out.events >= leave_after:
                    return Outcome("disconnected", "mid-stream", out.ttft, out.itls, out.events)
            if not stream.done:
                return Outcome("failed", "stream cut without [DONE]")
            return out
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return Outcome("failed", type(e).__name__)


async def before_first_byte(session, url, path, body, rng) -> Outcome:
    task = asyncio.create_task(one(session, url, path, body, "before", 0))
    await asyncio.sleep(rng.uniform(0.0, 0.05))
    if task.done():  # answered before we could leave: it counts as what it was
        return task.result()
    task.cancel()  # closes the connection mid-request
    try:
        await task
    except asyncio.CancelledError:
        pass
    return Outcome("disconnected", "before first byte")


async def drive(url: str, n: int, disconnect_share: float, concurrency: int, seed: int,
                model: str | None, max_tokens: int = 48, on_done=None) -> list[Outcome]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    finished = 0

    async def task(i, session):
        nonlocal finished
        path, body = make_request(rng, i, model, max_tokens)
        leave = None
        if rng.random() < disconnect_share:
            leave = rng.choice(("before", "mid"))
        leave_after = rng.randint(1, 6)
        async with sem:
            if leave == "before":
                out = await before_first_byte(session, url, path, body, rng)
            else:
                out = await one(session, url, path, body, leave, leave_after)
        finished += 1
        if on_done is not None:
            on_done(finished)
        return out

    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(task(i, session) for i in range(n)))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def settle(engine_urls: list[str], idle_kv: list[float], timeout: float = 60.0) -> list[dict]:
    """Engine states once every engine is back to idle (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for url, idle in zip(engine_urls, idle_kv):
            m = scrape_metrics(url)
            states.append({"url": url, "running": m["vllm:num_requests_running"],
                           "waiting": m["vllm:num_requests_waiting"],
                           "kv_usage": m["vllm:kv_cache_usage_perc"], "kv_idle": idle})
        if all(s["running"] == s["waiting"] == 0 and s["kv_usage"] <= s["kv_idle"]
               for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.25)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50_ms": None, "p99_ms": None}
    a = np.array(values) * 1000
    return {"p50_ms": round(percentile(a, 50), 1), "p99_ms": round(percentile(a, 99), 1)}


def report(outcomes: list[Outcome], engines_after: list[dict], rss: dict, seconds: float,
           disconnect_share: float) -> dict:
    failed: dict[str, int] = {}
    for o in outcomes:
        if o.kind == "failed":
            failed[o.cause] = failed.get(o.cause, 0) + 1
    disconnected: dict[str, int] = {}
    for o in outcomes:
        if o.kind == "disconnected":
            disconnected[o.cause] = disconnected.get(o.cause, 0) + 1
    stayed = [o for o in outcomes if o.kind != "disconnected"]
    return {
        "requests": len(outcomes), "disconnect_share": disconnect_share,
        "seconds": round(seconds, 1),
        "completed": sum(o.kind == "completed" for o in outcomes),
        "failed": sum(failed.values()), "failed_by_cause": failed,
        "disconnected": sum(disconnected.values()), "disconnected_by_point": disconnected,
        "ttft": percentiles([o.ttft for o in stayed if o.ttft is not None]),
        "itl": percentiles([x for o in stayed for x in o.itls]),
        "engines_after": engines_after,
        "leaked": any(e["running"] or e["waiting"] or e["kv_usage"] > e["kv_idle"]
                      for e in engines_after),
        "rss_mb": rss,
    }


def soak(gateway: ServerProcess, engines: list[ServerProcess], n: int,
         disconnect_share: float, concurrency: int, seed: int = 0,
         model: str | None = None, warm_up: int = 20, max_tokens: int = 48) -> dict:
    """Warm up, measure RSS, run the soak, let the engines settle, measure again."""
    asyncio.run(drive(gateway.url, warm_up, 0.0, concurrency, seed + 1, model, max_tokens))
    idle_kv = [s["kv_usage"] for s in settle([e.url for e in engines], [1.0] * len(engines))]
    procs = {"gateway": gateway, **{f"engine{i}": e for i, e in enumerate(engines)}}
    # RSS after the warm-up, at each quarter of the run and after it: growth that
    # flattens (caches and first-touched KV pages) versus growth that keeps on (a leak).
    samples: dict[str, list[float]] = {k: [rss_mb(p.proc.pid)] for k, p in procs.items()}
    marks = {n * q // 4 for q in (1, 2, 3)}

    def on_done(finished: int) -> None:
        if finished in marks:
            for k, p in procs.items():
                samples[k].append(rss_mb(p.proc.pid))

    t0 = time.perf_counter()
    outcomes = asyncio.run(drive(gateway.url, n, disconnect_share, concurrency, seed, model,
                                 max_tokens, on_done))
    seconds = time.perf_counter() - t0
    after = settle([e.url for e in engines], idle_kv)
    rss = {}
    for k, p in procs.items():
        points = [*samples[k], rss_mb(p.proc.pid)]
        half = points[len(points) // 2]
        rss[k] = {"after_warm_up": round(points[0], 1),
                  "quarters": [round(x, 1) for x in points[1:]],
                  "growth": round(points[-1] - points[0], 1),
                  "growth_second_half": round(points[-1] - half, 1)}
    return report(outcomes, after, rss, seconds, disconnect_share)


def start(model: str, n_engines: int, kv_bytes: int,
          num_threads: int | None) -> tuple[ServerProcess, list]:
    engines = []
    threads = ["--num-threads", str(num_threads)] if num_threads else []
    for i in range(n_engines):
        engines.append(ServerProcess(
            ["serve", "--model", model, "--served-model-name", "soak", "--log-level",
             "WARNING", "--kv-cache-memory", str(kv_bytes), *threads], f"127.0.0.{61 + i}",
            stdout=subprocess.DEVNULL))
    args = ["gateway", "--log-level", "WARNING", "--scrape-interval", "0.5"]
    for e in engines:
        args += ["--backend", e.url]
    return ServerProcess(args, "127.0.0.60"), engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--disconnect-share", type=float, default=0.3)
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    ap.add_argument("--max-tokens", type=int, default=48, help="per request: 8..this")
    ap.add_argument("--num-threads", type=int, default=None, help="per engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = ap.parse_args()
    gateway, engines = start(args.model, args.engines, args.kv_cache_memory, args.num_threads)
    try:
        result = soak(gateway, engines, args.requests, args.disconnect_share,
                      args.concurrency, args.seed, "soak", max_tokens=args.max_tokens)
    finally:
        for p in [gateway, *engines]:
            p.stop()
    result.update(model=args.model, engines=args.engines, concurrency=args.concurrency,
                  max_tokens=args.max_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "engines_after"}, indent=1))
    print("engines after:", json.dumps(result["engines_after"]))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
