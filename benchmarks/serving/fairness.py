"""Tenants and fairness through real gateway and engine processes (built-in model).

Parts (``--part``, default all):

- ``share``: two backlogged tenants, one sending 10x more and ~10x longer requests.
  Token share over a window (client-side usage of requests finished in it) with
  weights 1:1 and 2:1, and Jain's index of weight-normalised throughput; the same
  load through a gateway without tenants is the baseline.
- ``flood``: one tenant floods the batch class; another's interactive requests,
  one at a time: p50/p95 time to first token against the same requests unloaded,
  and the batch class's share of the tokens served meanwhile.
- ``replicas``: three gateway replicas sharing a 600 rpm limit by exchanging
  counters, traffic skewed 80/10/10 at twice the limit: accepted requests per
  minute; then one replica is killed and the rest is measured again.
- ``retry``: every 429 and 503 carries the OpenAI error body and Retry-After, and
  retrying after it succeeds.

    python benchmarks/serving/fairness.py                     # ~12 min on 2 cores
    python benchmarks/serving/fairness.py --part share --window 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.paths import RESULTS as RESULTS_DIR
from benchmarks.lib.percentiles import percentile
from benchmarks.lib.sse import EventStream
from llmserve.entrypoints.launcher import ServerProcess
from llmserve.utils import free_port

RESULTS = RESULTS_DIR / "fairness.json"
MODEL = "smollm2-135m-instruct"


def tenants_file(heavy_weight: float = 1, rpm: int | None = None) -> str:
    limits = f", limits: {{rpm: {rpm}}}" if rpm else ""
    return f"""
classes:
  - {{name: interactive, priority: 0, queueTimeoutSeconds: 300, maxQueued: 1000}}
  - {{name: batch, priority: 10, queueTimeoutSeconds: 600, maxQueued: 20000, minShare: 0.05}}
defaultClass: interactive
tenants:
  - {{name: heavy, apiKeys: [sk-heavy], weight: {heavy_weight}{limits}}}
  - {{name: light, apiKeys: [sk-light]}}
"""


class Stack:
    """One engine and N gateway replicas (peers of each other) on loopback."""

    def __init__(self, tenants: str | None, replicas: int = 1, max_in_flight: int = 8,
                 engine_args: tuple = ()):
        self.dir = tempfile.TemporaryDirectory()
        self.engine = ServerProcess(["serve", "--model", MODEL, "--max-num-seqs", "16",
                                     "--scheduling-policy", "priority",
                                     "--log-level", "WARNING", *engine_args], "127.0.0.61")
        ports = [free_port("127.0.0.62") for _ in range(replicas)]
        self.gateways = []
        for i, port in enumerate(ports):
            args = ["gateway", "--backend", self.engine.url, "--log-level", "WARNING",
                    "--scrape-interval", "0.5", "--max-in-flight", str(max_in_flight)]
            if tenants is not None:
                path = Path(self.dir.name) / "tenants.yaml"
                path.write_text(tenants)
                args += ["--tenants", str(path)]
                args += [a for j, p in enumerate(ports) if j != i
                         for a in ("--peer", f"http://127.0.0.62:{p}")]
            self.gateways.append(ServerProcess(args, "127.0.0.62", port=port))

    def stop(self) -> None:
        for p in [*self.gateways, self.engine]:
            p.stop()
        self.dir.cleanup()


async def request(session, url, key, *, prompt, max_tokens, cls=None, stream=False):
    """One completion: (status, usage tokens, ttft s, headers, body on error)."""
    headers = {"Authorization": f"Bearer {key}"}
    if cls:
        headers["x-priority-class"] = cls
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
        if r.status != 200:
            return r.status, 0, None, dict(r.headers), await r.json()
        if not stream:
            data = await r.json()
            return 200, data["usage"]["total_tokens"], None, dict(r.headers), None
        ttft, tokens = None, 0
        async for arrived, event in EventStream(r):
            if ttft is None and event["choices"]:
                ttft = arrived - t0
            if event.get("usage"):
                tokens = event["usage"]["total_tokens"]
        return 200, tokens, ttft, dict(r.headers), None


async def backlog(url, key, n_clients, until, served, window, **kw):
    """``n_clients`` clients sending back to back until ``until``; tokens of the
    requests that finish inside ``window`` go to ``served``."""
    async def client(session):
        while time.monotonic() < until:
            status, tokens, *_ = await request(session, url, key, **kw)
            if status != 200:
                served[f"{key} HTTP {status}"] = served.get(f"{key} HTTP {status}", 0) + 1
            elif window[0] <= time.monotonic() <= window[1]:
                served[key] = served.get(key, 0) + tokens
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        await asyncio.gather(*(client(s) for _ in range(n_clients)))


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


# --- parts ---------------------------------------------------------------------------
async def run_share(stack: Stack, warmup: float, seconds: float) -> dict[str, int]:
    url, served = stack.gateways[0].url, {}
    start = time.monotonic()
    window = (start + warmup, start + warmup + seconds)
    heavy = dict(prompt="a long story about tenants " * 10, max_tokens=8)  # ~68 tokens
    light = dict(prompt="short one", max_tokens=2)  # ~5 tokens
    # Both backlogged: each has more clients than the places (16) the gateway lets
    # the engine have, so each always has requests queued (a tenant whose requests
    # are all in flight is not backlogged and cannot claim a share). The heavy tenant
    # asks for ~13x the tokens: requests ~13x longer.
    await asyncio.gather(backlog(url, "sk-heavy", 40, window[1], served, window, **heavy),
                         backlog(url, "sk-light", 40, window[1], served, window, **light))
    return served


def part_share(args) -> dict:
    out = {}
    for label, tenants, weights in (("no tenants (FCFS baseline)", None, (1, 1)),
                                    ("weights 1:1", tenants_file(1), (1, 1)),
                                    ("weights 2:1", tenants_file(2), (2, 1))):
        stack = Stack(tenants, max_in_flight=16)  # the engine's batch; keys unchecked w/o tenants
        try:
            served = asyncio.run(run_share(stack, args.warmup, args.window))
        finally:
            stack.stop()
        h, lt = served.get("sk-heavy", 0), served.get("sk-light", 0)
        errors = {k: v for k, v in served.items() if "HTTP" in k}
        if errors:
            raise RuntimeError(f"{label}: requests failed: {errors}")
        ratio = h / max(lt, 1)
        out[label] = {"heavy_tokens": h, "light_tokens": lt, "ratio": round(ratio, 3),
                      "tokens_per_s": round((h + lt) / args.window, 1),
                      "target": weights[0] / weights[1],
                      "jain": round(jain([h / weights[0], lt / weights[1]]), 3) if h + lt else 0}
        print(f"[share] {label}: heavy {h} / light {lt} tokens = {ratio:.2f} "
              f"(fair: {weights[0] / weights[1]:.1f}), Jain {out[label]['jain']:.3f}, "
              f"{out[label]['tokens_per_s']} tokens/s in all",
              flush=True)
    return out


async def interactive_ttfts(url, n, warmup: int = 3) -> list[float]:
    out = []
    async with aiohttp.ClientSession() as s:
        for i in range(-warmup, n):  # the first requests of a process are slower
            status, _, ttft, *_ = await request(s, url, "sk-light", prompt=f"question {i}",
                                                max_tokens=8, cls="interactive", stream=True)
            assert status == 200, status
            if i >= 0:
                out.append(ttft)
            await asyncio.sleep(0.2)
    return out



def part_flood(args) -> dict:
    stack = Stack(tenants_file(), max_in_flight=args.flood_in_flight)
    try:
        url = stack.gateways[0].url
        unloaded = asyncio.run(interactive_ttfts(url, args.ttft_requests))

        async def loaded():
            served, until = {}, time.monotonic() + 3600
            window = [time.monotonic(), until]
            flood = asyncio.create_task(backlog(
                url, "sk-heavy", 32, until, served, window, prompt="bulk work " * 20,
                max_tokens=64, cls="batch"))
            await asyncio.sleep(args.warmup)
            before = dict(served)
            ttfts = await interactive_ttfts(url, args.ttft_requests)
            batch_tokens = served.get("sk-heavy", 0) - before.get("sk-heavy", 0)
            flood.cancel()
            await asyncio.gather(flood, return_exceptions=True)
            return ttfts, batch_tokens

        ttfts, batch_tokens = asyncio.run(loaded())
    finally:
        stack.stop()
    inter_tokens = args.ttft_requests * 10
    # nearest rank: a TTFT that some request saw, as so few requests want
    unloaded_p50, unloaded_p95 = (percentile(unloaded, q, "nearest") for q in (50, 95))
    loaded_p50, loaded_p95 = (percentile(ttfts, q, "nearest") for q in (50, 95))
    result = {"unloaded_p50": unloaded_p50, "unloaded_p95": unloaded_p95,
              "loaded_p50": loaded_p50, "loaded_p95": loaded_p95,
              "p95_ratio": loaded_p95 / unloaded_p95,
              "batch_token_share": batch_tokens / max(batch_tokens + inter_tokens, 1)}
    print(f"[flood] interactive TTFT p50/p95 unloaded {1e3 * result['unloaded_p50']:.0f}/"
          f"{1e3 * result['unloaded_p95']:.0f} ms, under a batch flood "
          f"{1e3 * result['loaded_p50']:.0f}/{1e3 * result['loaded_p95']:.0f} ms: p95 ratio "
          f"{result['p95_ratio']:.2f} (target <= 1.5); batch share of tokens "
          f"{result['batch_token_share']:.2f} (minShare 0.05)", flush=True)
    return result


async def paced(url, key, rate, until, log):
    """Open-loop arrivals at ``rate``/s until ``until``; logs (time, status)."""
    async with aiohttp.ClientSession() as s:
        tasks = []

        async def one():
            sent = time.monotonic()  # admission is decided on arrival
            status, *_ = await request(s, url, key, prompt="hi", max_tokens=1)
            log.append((sent, status))

        while time.monotonic() < until:
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(1 / rate)
        await asyncio.gather(*tasks, return_exceptions=True)


def part_replicas(args) -> dict:
    """Two minutes of traffic (the second is measured), then one replica is killed
    and two more minutes run on the others (the last is measured)."""
    limit, demand, shares = 600, 1200, (0.8, 0.1, 0.1)  # per minute
    stack = Stack(tenants_file(rpm=limit), replicas=3, max_in_flight=16)
    logs = [[] for _ in shares]
    try:
        async def traffic():
            t0 = time.monotonic()
            runs = [asyncio.create_task(paced(g.url, "sk-heavy", demand / 60 * share,
                                              t0 + (120 if i == 2 else 240), log))
                    for i, (g, share, log) in enumerate(zip(stack.gateways, shares, logs))]
            await asyncio.sleep(120)
            stack.gateways[2].proc.send_signal(signal.SIGKILL)
            await asyncio.gather(*runs)
            return t0

        t0 = asyncio.run(traffic())
    finally:
        stack.stop()

    def accepted(log, start, end):
        return sum(1 for t, status in log if status == 200 and t0 + start <= t < t0 + end)

    per_replica = [accepted(log, 60, 120) for log in logs]
    result = {"limit": limit, "demand_per_minute": demand, "skew": shares,
              "accepted_minute_2": sum(per_replica), "per_replica": per_replica,
              "accepted_minute_3_kill": sum(accepted(log, 120, 180) for log in logs),
              "accepted_minute_4_two_left": sum(accepted(log, 180, 240) for log in logs)}
    print(f"[replicas] 3 replicas, {demand} rpm offered 80/10/10 against {limit} rpm: "
          f"{result['accepted_minute_2']} accepted in minute 2 {per_replica} (target "
          f"570-630); replica 3 killed at 2:00: minute 3 {result['accepted_minute_3_kill']}, "
          f"minute 4 {result['accepted_minute_4_two_left']} (target <= 630)", flush=True)
    return result


def part_retry(args) -> dict:
    stack = Stack(tenants_file(rpm=3), max_in_flight=8)

    async def main():
        async with aiohttp.ClientSession() as s:
            url = stack.gateways[0].url
            for _ in range(3):
                assert (await request(s, url, "sk-heavy", prompt="x", max_tokens=1))[0] == 200
            status, _, _, headers, body = await request(s, url, "sk-heavy", prompt="x",
                                                        max_tokens=1)
            assert status == 429 and body["error"]["type"] == "rate_limit_exceeded"
            wait = int(headers["retry-after-ms"]) / 1000
            print(f"[retry] 429 {body['error']['message']!r}, Retry-After "
                  f"{headers['Retry-After']} s", flush=True)
            await asyncio.sleep(wait)
            retried = (await request(s, url, "sk-heavy", prompt="x", max_tokens=1))[0]
            return {"status": status, "retry_after_s": wait, "retried_status": retried}

    try:
        result = asyncio.run(main())
    finally:
        stack.stop()
    print(f"[retry] after waiting Retry-After: HTTP {result['retried_status']}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["all", "share", "flood", "replicas", "retry"],
                    default="all")
    ap.add_argument("--warmup", type=float, default=20.0,
                    help="seconds before the window: past the start's burst")
    ap.add_argument("--window", type=float, default=90.0)
    ap.add_argument("--ttft-requests", type=int, default=30)
    ap.add_argument("--flood-in-flight", type=int, default=16,
                    help="flood: requests of a class the gateway lets the engine have")
    args = ap.parse_args()
    parts = {"share": part_share, "flood": part_flood, "replicas": part_replicas,
             "retry": part_retry}
    chosen = parts if args.part == "all" else {args.part: parts[args.part]}
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for name, fn in chosen.items():
        results[name] = fn(args)
        RESULTS.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
