"""Prefill/decode disaggregation against colocated engines, equal resources, same run.

Two engines (``--num-threads 1`` each, the same model, dtype and KV size) behind the
gateway, in two configurations run back to back (``--repeat`` alternates them):

- ``A`` colocated: 2 x ``llmserve serve`` (``--kv-role both``) behind
  ``llmserve gateway --backend A --backend B``;
- ``B`` P/D: 1 x ``--kv-role prefill --kv-transfer-port 0`` + 1 x ``--kv-role decode``
  behind ``llmserve gateway --backend DECODE --prefill-backend PREFILL``
  (``--kv-transfer-backend``, default auto: NIXL where it loads; the engine log's
  "KV transfer: role ..., transport ..." line says which it used).

Workload, through the gateway's HTTP endpoint only: ``--chat-streams`` chat streams
decode continuously (a short chat prompt, ``--chat-max-tokens`` tokens with
ignore_eos, streamed, back to back) while ``--long-tokens``-token prompts (token ids,
each new, so no prefix-cache hits; ``--long-max-tokens`` tokens, streamed) arrive every
``--long-every`` s. After ``--warmup`` s of the same workload, ``--duration`` s are
measured: chat inter-token latencies stamped in the window, chat TTFTs of requests
sent in it, long prompts sent in it (the chats keep running until they are answered),
output tokens stamped in it. Then, with the chats stopped, ``--idle-long`` long prompts
go one at a time through the gateway (unloaded TTFT; for B, the KV transfer against
the prefill engine's own prefill time of the same prompt).

KV transfer (B): ``llmserve:kv_transfer_seconds`` and
``llmserve:kv_transfer_tokens_total{direction="received"}`` of the decode engine,
times the KV bytes per token (layers x 2 x KV heads x head_dim x dtype bytes), give
GB/s and ms per 1k tokens; the prefill time a transfer is compared with is the prefill
engine's TTFT less its queue time (``vllm:time_to_first_token_seconds`` -
``vllm:request_queue_time_seconds``) for the same requests.

    python benchmarks/serving/disaggregation.py --long-every 45 --warmup 45 \\
        --duration 180                                              # ~10 min
    python benchmarks/serving/disaggregation.py --configs B,A ...   # the other order
    python benchmarks/serving/disaggregation.py                     # a long prompt every 8 s
    python benchmarks/serving/disaggregation.py --duration 8 --warmup 4 --long-every 4 \\
        --long-tokens 600 --warm-tokens 300 --idle-long 1   # smoke, ~2 min
    python benchmarks/serving/disaggregation.py --replot RESULTS.json --plot PNG

With one thread per engine a 4,000-token prefill takes ~20 s on a 2-core Xeon, so one
every 8 s overloads both deployments (and the run waits minutes for the queued prompts);
docs/benchmarks.md has both regimes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.paths import FIGURES, RESULTS
from benchmarks.lib.percentiles import percentile
from benchmarks.lib.sse import EventStream
from llmserve.entrypoints.launcher import ServerProcess, scrape_metrics

TOPICS = ("a lighthouse keeper", "a robot learning to paint", "the history of tea",
          "a city under the sea", "a dragon who collects clocks", "the first mission to Mars",
          "a forest that walks", "a detective cat", "a library with no end",
          "an orchestra of insects")
LABELS = {"A": "A: 2 colocated engines", "B": "B: 1 prefill + 1 decode engine"}
TARGETS = {"chat_p99_itl": 0.5, "long_ttft_p50": 1.3, "transfer_of_prefill": 0.10}


@dataclass
class Rec:
    kind: str  # chat | long | idle
    start: float  # seconds since the run's t0
    stamps: list[float] = field(default_factory=list)  # each content chunk's arrival
    output_tokens: int = 0
    ok: bool = False
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.stamps[0] - self.start if self.stamps else None


# --- client ---------------------------------------------------------------------------------
async def stream(session, url: str, body: dict, rec: Rec, t0: float) -> Rec:
    """One streamed request; ``rec`` is filled in as chunks arrive (a cancelled caller
    keeps what was measured)."""
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {**body, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0, "ignore_eos": True}
    rec.start = time.perf_counter() - t0
    try:
        async with session.post(url + path, json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for arrived, event in EventStream(resp):
                now = arrived - t0
                if event.get("usage"):
                    rec.output_tokens = event["usage"]["completion_tokens"]
                for c in event.get("choices") or ():
                    text = c.get("delta", {}).get("content") if chat else c.get("text")
                    if text or (not chat and c.get("finish_reason") is None):
                        rec.stamps.append(now)
                        break
        rec.ok = True
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        rec.error = repr(e)
    return rec


def chat_body(model: str, stream_id: int, round_: int, max_tokens: int) -> dict:
    topic = TOPICS[stream_id % len(TOPICS)]
    return {"model": model, "max_tokens": max_tokens, "messages": [
        {"role": "user", "content": f"Tell me a long story about {topic}. "
                                    f"(stream {stream_id}, round {round_})"}]}


def long_body(model: str, rng: random.Random, tokens: int, max_tokens: int) -> dict:
    return {"model": model, "max_tokens": max_tokens,
            "prompt": [rng.randrange(1000, 40000) for _ in range(tokens)]}


async def workload(url: str, model: str, args, rng: random.Random) -> dict:
    recs: list[Rec] = []
    t0 = time.perf_counter()
    w0, w1 = args.warmup, args.warmup + args.duration
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=900)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def chat_loop(i: int) -> None:
            k = 0
            while not stop.is_set():
                rec = Rec("chat", 0.0)
                recs.append(rec)
                await stream(session, url, chat_body(model, i, k, args.chat_max_tokens),
                             rec, t0)
                k += 1

        chats = [asyncio.create_task(chat_loop(i)) for i in range(args.chat_streams)]
        longs = []
        t = 1.0
        while t < w1:
            await asyncio.sleep(max(0.0, t - (time.perf_counter() - t0)))
            rec = Rec("long", 0.0)
            recs.append(rec)
            longs.append(asyncio.create_task(stream(
                session, url, long_body(model, rng, args.long_tokens, args.long_max_tokens),
                rec, t0)))
            t += args.long_every
        await asyncio.sleep(max(0.0, w1 - (time.perf_counter() - t0)))
        await asyncio.gather(*longs)  # the chats keep the load on until these finish
        stop.set()
        for c in chats:
            c.cancel()
        await asyncio.gather(*chats, return_exceptions=True)
    return {"recs": recs, "window": (w0, w1)}


async def idle_longs(url: str, model: str, args, rng: random.Random, count: int,
                     between=None) -> list[Rec]:
    """Long prompts one at a time on an otherwise idle deployment; ``between()`` runs
    after each (a metrics scrape)."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        for _ in range(count):
            t0 = time.perf_counter()
            rec = await stream(session, url, long_body(model, rng, args.long_tokens,
                                                       args.long_max_tokens),
                               Rec("idle", 0.0), t0)
            out.append(rec)
            if between:
                await asyncio.to_thread(between)
    return out


async def warm(urls: list[str], model: str, args, rng: random.Random) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        await asyncio.gather(*(stream(session, url, long_body(model, rng, args.warm_tokens, 4),
                                      Rec("warm", 0.0), time.perf_counter()) for url in urls))
        await asyncio.gather(*(stream(session, url, chat_body(model, 99, 0, 8),
                                      Rec("warm", 0.0), time.perf_counter()) for url in urls))


# --- one configuration ---------------------------------------------------------------------
def start_config(name: str, args, env: dict, logdir: Path, host_base: int):
    common = ["serve", "--model", args.model, "--num-threads", "1", "--kv-cache-memory",
              str(args.kv_cache_memory), "--log-level", "INFO"]
    if args.dtype:
        common += ["--dtype", args.dtype]
    if name == "A":
        roles = {"engine-0": [], "engine-1": []}
    else:
        roles = {"prefill": ["--kv-role", "prefill", "--kv-transfer-port", "0",
                             "--kv-transfer-backend", args.kv_transfer_backend],
                 "decode": ["--kv-role", "decode",
                            "--kv-transfer-backend", args.kv_transfer_backend]}
    engines, logs = {}, {}
    try:
        for i, (role, extra) in enumerate(roles.items()):
            logs[role] = logdir / f"{name}-{role}.log"
            with open(logs[role], "wb") as f:
                engines[role] = ServerProcess(common + extra, f"127.0.0.{host_base + i}",
                                              env=env, stdout=f)
        if name == "A":
            backends = sum((["--backend", e.url] for e in engines.values()), [])
        else:
            backends = ["--backend", engines["decode"].url,
                        "--prefill-backend", engines["prefill"].url]
        logs["gateway"] = logdir / f"{name}-gateway.log"
        with open(logs["gateway"], "wb") as f:
            gw = ServerProcess(["gateway", "--log-level", "WARNING", *backends],
                               f"127.0.0.{host_base + 9}", env=env, stdout=f)
    except BaseException:
        for e in engines.values():
            e.stop()
        raise
    return engines, gw, logs


def transports(logs: dict) -> dict:
    out = {}
    for role, path in logs.items():
        m = re.search(r"KV transfer: role (\S+), transport (\S+)", path.read_text(errors="replace"))
        if m:
            out[role] = {"role": m.group(1).rstrip(","), "transport": m.group(2)}
    return out


def scrape_all(engines: dict) -> dict:
    return {role: scrape_metrics(e.url) for role, e in engines.items()}


def delta(after: dict, before: dict, role: str, key: str) -> float:
    return after[role].get(key, 0.0) - before[role].get(key, 0.0)


def transfer_stats(before: dict, after: dict, kv_bytes_per_token: int) -> dict | None:
    """The decode engine's imports and the prefill engine's prefill time between two
    scrapes."""
    n = delta(after, before, "decode", "llmserve:kv_transfer_seconds_count")
    if n <= 0:
        return None
    secs = delta(after, before, "decode", "llmserve:kv_transfer_seconds_sum")
    toks = delta(after, before, "decode", "llmserve:kv_transfer_tokens_total")  # received
    reqs = delta(after, before, "prefill", "vllm:time_to_first_token_seconds_count")
    ttft = delta(after, before, "prefill", "vllm:time_to_first_token_seconds_sum")
    queue = delta(after, before, "prefill", "vllm:request_queue_time_seconds_sum")
    qn = delta(after, before, "prefill", "vllm:request_queue_time_seconds_count")
    prefill_s = (ttft - queue) / reqs if reqs and qn == reqs else None
    out = {"imports": n, "tokens": toks, "seconds": secs,
           "per_import_ms": 1e3 * secs / n, "tokens_per_import": toks / n,
           "gb_per_s": toks * kv_bytes_per_token / secs / 1e9 if secs else None,
           "ms_per_1k_tokens": 1e3 * secs / (toks / 1e3) if toks else None,
           "prefill_requests": reqs, "prefill_ttft_ms": 1e3 * ttft / reqs if reqs else None,
           "prefill_ms": 1e3 * prefill_s if prefill_s is not None else None,
           "failures": delta(after, before, "decode", "llmserve:kv_transfer_failures_total")}
    out["transfer_of_prefill"] = (out["per_import_ms"] / out["prefill_ms"]
                                  if out["prefill_ms"] else None)
    return out


def busy(metrics: dict, what: str = "sum") -> float:
    """Seconds an engine spent in steps (or how many steps) so far."""
    return sum(v for k, v in metrics.items()
               if k.startswith(f"llmserve:step_duration_seconds_{what}{{")
               and 'kind="actual"' in k)



def summarize(result: dict) -> dict:
    recs: list[Rec] = result["recs"]
    w0, w1 = result["window"]
    chats = [r for r in recs if r.kind == "chat"]
    longs = [r for r in recs if r.kind == "long" and w0 <= r.start < w1]
    itl = [(b, 1e3 * (b - a)) for r in chats for a, b in zip(r.stamps, r.stamps[1:])
           if w0 <= b < w1]
    # A chat cut off when the run ends still has its TTFT; one that never got a token is
    # counted apart (its TTFT is longer than what remained of the run).
    started = [r for r in chats if w0 <= r.start < w1]
    chat_ttft = [1e3 * r.ttft for r in started if r.ttft is not None]
    long_ttft = [1e3 * r.ttft for r in longs if r.ttft is not None]
    tokens = sum(1 for r in recs for s in r.stamps if w0 <= s < w1)
    itl_ms = [v for _, v in itl]
    return {
        "chat_itl_ms": {"p50": percentile(itl_ms, 50), "p99": percentile(itl_ms, 99), "max":
                        max(itl_ms) if itl_ms else None, "n": len(itl_ms)},
        "chat_ttft_ms": {"p50": percentile(chat_ttft, 50), "p99": percentile(chat_ttft, 99),
                         "n": len(chat_ttft), "no_first_token": len(started) - len(chat_ttft)},
        "long_ttft_ms": {"p50": percentile(long_ttft, 50), "p99": percentile(long_ttft, 99),
                         "n": len(long_ttft), "all": long_ttft},
        "output_tokens_per_s": tokens / (w1 - w0),
        "errors": [r.error for r in recs if r.error][:5],
        "num_errors": sum(1 for r in recs if r.error),
        "long_incomplete": sum(1 for r in longs if not r.ok),
        "itl_series": [(round(t - w0, 3), round(v, 1)) for t, v in sorted(itl)],
        "long_arrivals": [round(r.start - w0, 3) for r in longs],
        "requests": [{"kind": r.kind, "start": round(r.start - w0, 3), "tokens": len(r.stamps),
                      "ttft_ms": None if r.ttft is None else round(1e3 * r.ttft, 1),
                      "ok": r.ok} for r in recs],
    }


def run_config(name: str, args, env: dict, logdir: Path, host_base: int,
               kv_bytes_per_token: int) -> dict:
    rng = random.Random(args.seed)
    print(f"== {name}: starting engines and gateway", flush=True)
    engines, gw, logs = start_config(name, args, env, logdir, host_base)
    try:
        # Warm each engine directly, then the path through the gateway (for B: leg 1,
        # the transport's first connection); not measured.
        asyncio.run(warm([e.url for e in engines.values()], args.model, args, rng))
        asyncio.run(warm([gw.url], args.model, args, rng))
        before = scrape_all(engines)
        gw_before = scrape_metrics(gw.url)
        t_before = time.perf_counter()
        load_before = os.getloadavg()[0]
        print(f"   {args.chat_streams} chat streams, a {args.long_tokens}-token prompt "
              f"every {args.long_every:g} s: {args.warmup:g} s warm-up + {args.duration:g} s",
              flush=True)
        result = workload(gw.url, args.model, args, rng)
        result = asyncio.run(result)
        after = scrape_all(engines)
        gw_after = scrape_metrics(gw.url)
        summary = summarize(result)
        summary["loadavg_1m_before_after"] = [load_before, os.getloadavg()[0]]  # host noise
        summary["scraped_over_s"] = time.perf_counter() - t_before  # busy_s is out of this
        summary["gateway_pd"] = {k.split("{", 1)[1].rstrip("}"): gw_after[k] - gw_before.get(k, 0)
                                 for k in gw_after
                                 if k.startswith("llmserve_gateway_pd_requests_total{")}
        n = (gw_after.get("llmserve_gateway_pd_prefill_seconds_count", 0)
             - gw_before.get("llmserve_gateway_pd_prefill_seconds_count", 0))
        if n:
            summary["leg1_mean_ms"] = 1e3 * (
                gw_after["llmserve_gateway_pd_prefill_seconds_sum"]
                - gw_before.get("llmserve_gateway_pd_prefill_seconds_sum", 0)) / n
        summary["engines"] = {role: {
            "prompt_tokens": delta(after, before, role, "vllm:prompt_tokens_total"),
            "generation_tokens": delta(after, before, role, "vllm:generation_tokens_total"),
            "preemptions": delta(after, before, role, "vllm:num_preemptions_total"),
            "busy_s": busy(after[role]) - busy(before[role]),
            "steps": busy(after[role], "count") - busy(before[role], "count")}
            for role in engines}
        if name == "B":
            summary["transfer_loaded"] = transfer_stats(before, after, kv_bytes_per_token)
        # Unloaded: one long prompt at a time through the gateway.
        scrapes = [scrape_all(engines)]
        idle = asyncio.run(idle_longs(gw.url, args.model, args, rng, args.idle_long,
                                      between=lambda: scrapes.append(scrape_all(engines))))
        summary["idle_long_ttft_ms"] = [1e3 * r.ttft for r in idle if r.ttft is not None]
        if name == "B":
            summary["transfer_idle"] = transfer_stats(scrapes[0], scrapes[-1],
                                                      kv_bytes_per_token)
    finally:
        gw.stop()
        for e in engines.values():
            e.stop()
    summary["transports"] = transports(logs)
    return summary


# --- report ---------------------------------------------------------------------------------
def fmt(v, unit="", digits=0):
    return "-" if v is None else f"{v:,.{digits}f}{unit}"


def print_summary(name: str, s: dict) -> None:
    print(f"== {name}")
    print(f"   chat ITL p50 {fmt(s['chat_itl_ms']['p50'], ' ms')}, p99 "
          f"{fmt(s['chat_itl_ms']['p99'], ' ms')} ({s['chat_itl_ms']['n']} gaps); chat TTFT "
          f"p50 {fmt(s['chat_ttft_ms']['p50'], ' ms')}, p99 {fmt(s['chat_ttft_ms']['p99'], ' ms')}"
          f" ({s['chat_ttft_ms']['n']} chats; {s['chat_ttft_ms'].get('no_first_token', 0)} "
          "started in the window got no token before the end)")
    print(f"   long TTFT p50 {fmt(s['long_ttft_ms']['p50'], ' ms')}, p99 "
          f"{fmt(s['long_ttft_ms']['p99'], ' ms')} ({s['long_ttft_ms']['n']} prompts); "
          f"unloaded {', '.join(fmt(x, ' ms') for x in s['idle_long_ttft_ms'])}")
    print(f"   output {s['output_tokens_per_s']:.1f} tokens/s; errors {s['num_errors']}"
          + (f" e.g. {s['errors'][0]}" if s["errors"] else ""))
    print(f"   engines: {s['engines']}; transports: {s['transports'] or 'none (colocated)'}")
    if s.get("gateway_pd"):
        print(f"   gateway P/D: {s['gateway_pd']}; leg 1 mean {fmt(s.get('leg1_mean_ms'), ' ms')}")
    for key in ("transfer_loaded", "transfer_idle"):
        t = s.get(key)
        if t:
            share = t["transfer_of_prefill"]
            print(f"   KV transfer ({key[9:]}): {t['imports']:.0f} imports, "
                  f"{t['tokens_per_import']:.0f} tokens each, {t['per_import_ms']:.1f} ms each, "
                  f"{fmt(t['gb_per_s'], ' GB/s', 2)}, {fmt(t['ms_per_1k_tokens'], ' ms', 2)} per "
                  f"1k tokens; prefill {fmt(t['prefill_ms'], ' ms')} per prompt (TTFT on the "
                  f"prefill engine {fmt(t['prefill_ttft_ms'], ' ms')}) -> transfer "
                  f"{fmt(100 * share if share else None, ' %', 1)}"
                  f" of prefill; failures {t['failures']:.0f}")


def ratios(a: dict, b: dict) -> dict:
    def r(x, y):
        return y / x if x and y is not None else None
    t = b.get("transfer_idle") or b.get("transfer_loaded") or {}
    return {
        "chat_p50_itl": r(a["chat_itl_ms"]["p50"], b["chat_itl_ms"]["p50"]),
        "chat_p99_itl": r(a["chat_itl_ms"]["p99"], b["chat_itl_ms"]["p99"]),
        "chat_p50_ttft": r(a["chat_ttft_ms"]["p50"], b["chat_ttft_ms"]["p50"]),
        "chat_p99_ttft": r(a["chat_ttft_ms"]["p99"], b["chat_ttft_ms"]["p99"]),
        "long_ttft_p50": r(a["long_ttft_ms"]["p50"], b["long_ttft_ms"]["p50"]),
        "long_ttft_p99": r(a["long_ttft_ms"]["p99"], b["long_ttft_ms"]["p99"]),
        "output_throughput": r(a["output_tokens_per_s"], b["output_tokens_per_s"]),
        "transfer_of_prefill": t.get("transfer_of_prefill"),
        "transfer_of_prefill_loaded": (b.get("transfer_loaded") or {}).get(
            "transfer_of_prefill"),
    }


def print_ratios(rt: dict) -> None:
    print("== B / A")
    for k, v in rt.items():
        target = TARGETS.get(k)
        verdict = "" if target is None or v is None else (
            f"  (target <= {target:g}: {'met' if v <= target else 'MISSED'})")
        print(f"   {k:28} {fmt(v, '', 3)}{verdict}")


def plot(runs: list[tuple[str, dict]], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("   matplotlib not installed: no plot")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), sharex=True,
                             sharey=True, squeeze=False)
    for ax, (label, s) in zip(axes[:, 0], runs):
        t = [x for x, _ in s["itl_series"]]
        v = [y for _, y in s["itl_series"]]
        ax.scatter(t, v, s=3, alpha=0.5)
        for i, at in enumerate(s["long_arrivals"]):
            ax.axvline(at, color="red", linewidth=0.7, alpha=0.6,
                       label="long prompt sent" if i == 0 else None)
        ax.set_yscale("log")
        ax.set_ylabel("chat ITL (ms)")
        ax.set_title(f"{label}: p50 {fmt(s['chat_itl_ms']['p50'], ' ms')}, "
                     f"p99 {fmt(s['chat_itl_ms']['p99'], ' ms')}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds into the measured window")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default=None, help="engine --dtype (default: the engine's)")
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30,
                    help="KV cache bytes, every engine")
    ap.add_argument("--kv-transfer-backend", choices=["auto", "nixl", "tcp"], default="auto")
    ap.add_argument("--chat-streams", type=int, default=8)
    ap.add_argument("--chat-max-tokens", type=int, default=128)
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--long-max-tokens", type=int, default=16)
    ap.add_argument("--long-every", type=float, default=8.0, help="seconds between long prompts")
    ap.add_argument("--warmup", type=float, default=20.0,
                    help="seconds of the workload before the measured window")
    ap.add_argument("--warm-tokens", type=int, default=600,
                    help="prompt of the requests that warm each engine before the workload")
    ap.add_argument("--duration", type=float, default=90.0, help="measured seconds")
    ap.add_argument("--idle-long", type=int, default=2,
                    help="long prompts sent alone after the workload")
    ap.add_argument("--configs", default="A,B", help="order, e.g. A,B or B,A")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the configurations this many times, alternating")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(RESULTS / "disaggregation.json"))
    ap.add_argument("--plot", default=str(FIGURES / "disaggregation_itl.png"))
    ap.add_argument("--logs", default=None, help="engine/gateway logs here (default: a tmp dir)")
    ap.add_argument("--replot", default=None, help="redraw --plot from this JSON and exit")
    args = ap.parse_args()
    if args.replot:
        report = json.loads(Path(args.replot).read_text())
        plot([(LABELS.get(r["config"], r["config"]), r) for r in report["runs"]],
             Path(args.plot))
        return

    from llmserve.model_executor.model_loader.sources import load_config, resolve_model
    from llmserve.platforms.cpu import auto_dtype
    from llmserve.worker.kv_sizing import kv_block_bytes
    dtype = args.dtype or auto_dtype("cpu")
    elem = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    kv_bytes_per_token = kv_block_bytes(load_config(resolve_model(args.model)), 1, elem)
    env = {"LLMSERVE_KV_TRANSFER_SECRET": secrets.token_hex(16)}
    logdir = Path(args.logs or tempfile.mkdtemp(prefix="disagg-bench-"))
    logdir.mkdir(parents=True, exist_ok=True)
    order = args.configs.split(",")
    if args.repeat > 1:
        order = [c for i in range(args.repeat) for c in (order if i % 2 == 0 else order[::-1])]
    print(f"KV bytes per token: {kv_bytes_per_token} ({dtype}); logs in {logdir}")
    runs: list[tuple[str, dict]] = []
    for i, name in enumerate(order):
        s = run_config(name, args, env, logdir, 60 + 10 * i, kv_bytes_per_token)
        print_summary(name, s)
        runs.append((name, s))
    report = {"args": vars(args), "kv_bytes_per_token": kv_bytes_per_token, "dtype": dtype,
              "cpu": _cpu(), "runs": [{"config": n, **s} for n, s in runs]}
    if {"A", "B"} <= {n for n, _ in runs}:
        # Each B against the A run next to it (the first A for the first B, ...).
        a_runs = [s for n, s in runs if n == "A"]
        b_runs = [s for n, s in runs if n == "B"]
        report["ratios"] = [ratios(a, b) for a, b in zip(a_runs, b_runs)]
        for rt in report["ratios"]:
            print_ratios(rt)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    if plot([(LABELS.get(n, n), s) for n, s in runs], Path(args.plot)):
        print(f"wrote {args.json} and {args.plot}")
    else:
        print(f"wrote {args.json}")


def _cpu() -> dict:
    out = {"cores": os.cpu_count()}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        m = re.search(r"Model name:\s*(.+)", text)
        out["model"] = m.group(1).strip() if m else None
    except OSError:
        pass
    return out


if __name__ == "__main__":
    main()
