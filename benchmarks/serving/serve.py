"""Serving benchmark in the spirit of vLLM's `bench serve`.

Sends streamed /v1/completions requests (prompts as token ids, so lengths are
exact) with Poisson arrivals at --request-rate or a fixed --max-concurrency, and
reports request/token throughput and mean/p50/p99 of TTFT, TPOT, ITL and E2E
latency; writes JSON and a PNG.

    # against a running server
    python benchmarks/serving/serve.py --url http://127.0.0.1:8000 --dataset random \\
        --num-prompts 64 --input-len 256 --output-len 64 --request-rate 4

    # chunked prefill: ITL of running streams while 4,000-token prompts arrive,
    # one server with chunked prefill and one without, same run
    python benchmarks/serving/serve.py --compare-chunking
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.paths import RESULTS
from benchmarks.lib.percentiles import summary_ms
from benchmarks.lib.server import served_model
from benchmarks.lib.sse import EventStream


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    start: float = 0.0
    ok: bool = False
    tag: str = ""
    error: str = ""


# --- workloads ---------------------------------------------------------------------------
def random_dataset(n, input_len, output_len, range_ratio, rng):
    out = []
    for _ in range(n):
        il = rng.randint(int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio)))
        ol = rng.randint(max(1, int(output_len * (1 - range_ratio))),
                         int(output_len * (1 + range_ratio)))
        out.append(([rng.randrange(100, 40000) for _ in range(max(il, 1))], ol, "random"))
    return out


def shared_prefix_dataset(n, num_prefixes, prefix_len, suffix_len, output_len, rng):
    prefixes = [[rng.randrange(100, 40000) for _ in range(prefix_len)]
                for _ in range(num_prefixes)]
    return [(prefixes[i % num_prefixes] + [rng.randrange(100, 40000) for _ in range(suffix_len)],
             output_len, f"prefix{i % num_prefixes}") for i in range(n)]


# --- client --------------------------------------------------------------------------------
async def one_request(session, url, model, prompt, max_tokens, tag,
                      res: RequestResult | None = None) -> RequestResult:
    """One streamed request. ``res`` (optional) is filled in as tokens arrive, so a
    caller that cancels the request still has what was measured."""
    res = res or RequestResult(prompt_len=len(prompt))
    res.tag = tag
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res.start = t0 = time.perf_counter()
    last = None
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for now, event in EventStream(resp):
                if event.get("usage"):
                    res.output_len = event["usage"]["completion_tokens"]
                if not event.get("choices"):
                    continue
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itls.append(now - last)
                last = now
        res.e2e = time.perf_counter() - t0
        res.ok = True
    except aiohttp.ClientError as e:
        res.error = repr(e)
    return res


async def run_workload(url, model, workload, request_rate, max_concurrency, seed):
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency or len(workload) or 1)
    timeout = aiohttp.ClientTimeout(total=3600)

    async def limited(session, item):
        async with sem:
            return await one_request(session, url, model, *item)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = []
        t0 = time.perf_counter()
        for item in workload:
            tasks.append(asyncio.create_task(limited(session, item)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return results, wall


# --- statistics ------------------------------------------------------------------------------
def summarize(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "wall_s": wall,
        "request_throughput": len(ok) / wall,
        "output_token_throughput": out_tokens / wall,
        "total_token_throughput": (out_tokens + sum(r.prompt_len for r in ok)) / wall,
        "ttft_ms": summary_ms([r.ttft for r in ok]),
        "tpot_ms": summary_ms([(r.e2e - r.ttft) / (r.output_len - 1)
                               for r in ok if r.output_len > 1]),
        "itl_ms": summary_ms([x for r in ok for x in r.itls]),
        "e2e_ms": summary_ms([r.e2e for r in ok]),
    }


def print_summary(name: str, s: dict, keys=("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")) -> None:
    print(f"== {name}: {s['completed']} ok, {s['failed']} failed in {s['wall_s']:.1f} s")
    print(f"   requests/s {s['request_throughput']:.2f}   output tokens/s "
          f"{s['output_token_throughput']:.1f}   total tokens/s {s['total_token_throughput']:.1f}")
    for key in keys:
        v = s[key]
        if v["mean"] is not None:
            print(f"   {key[:-3].upper():5} mean {v['mean']:9.1f} ms   p50 {v['p50']:9.1f} ms   "
                  f"p99 {v['p99']:9.1f} ms")



# --- chunked prefill comparison -------------------------------------------------------------
async def chunking_workload(url, model, args):
    """Background streams decode while long prompts arrive one after another. The
    background streams run until the last long prompt is answered; only their
    inter-token latencies in that window count."""
    rng = random.Random(args.seed)
    long_prompts = [[rng.randrange(100, 40000) for _ in range(args.long_prompt_len)]
                    for _ in range(args.long_prompts)]
    bg = [RequestResult(prompt_len=32) for _ in range(args.background_streams)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.perf_counter()
        bg_tasks = [asyncio.create_task(one_request(
            session, url, model, [rng.randrange(100, 40000) for _ in range(32)],
            args.background_max_tokens, "bg", r)) for r in bg]
        await asyncio.sleep(args.long_prompt_delay)
        marks = [len(r.itls) for r in bg]
        long_results = [await one_request(session, url, model, p, 4, "long")
                        for p in long_prompts]
        window = [r.itls[m:] for r, m in zip(bg, marks)]
        for t in bg_tasks:
            t.cancel()
        await asyncio.gather(*bg_tasks, return_exceptions=True)
        wall = time.perf_counter() - t0
    for r, itls in zip(bg, window):
        r.itls, r.ok = itls, True
    return bg + long_results, wall


def compare_chunking(args) -> dict:
    from llmserve.entrypoints.launcher import ServerProcess
    common = ["serve", "--model", args.model, "--log-level", "WARNING"]
    configs = {"chunked": [], "unchunked": ["--no-chunked-prefill"]}
    if args.max_num_batched_tokens:
        configs["chunked"] += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    report = {}
    for name, extra in configs.items():
        proc = ServerProcess(common + extra, "127.0.0.1", stdout=subprocess.DEVNULL)
        try:
            results, wall = asyncio.run(chunking_workload(proc.url, served_model(proc.url), args))
        finally:
            proc.stop()
        bg = [r for r in results if r.tag == "bg"]
        report[name] = {"summary": summarize(bg, wall),
                        "bg_itls_ms": [x * 1000 for r in bg for x in r.itls],
                        "long_ttft_ms": [r.ttft * 1000 for r in results if r.tag == "long"]}
        print_summary(f"{name}: background streams while long prompts arrive",
                      report[name]["summary"], keys=("itl_ms",))
        print(f"   long prompts' TTFT (ms): "
              f"{', '.join(f'{t:.0f}' for t in report[name]['long_ttft_ms'])}")
    ratio = (report["chunked"]["summary"]["itl_ms"]["p99"]
             / report["unchunked"]["summary"]["itl_ms"]["p99"])
    report["p99_itl_ratio_chunked_over_unchunked"] = ratio
    print(f"p99 ITL of running streams, chunked / unchunked: {ratio:.3f}")
    return report


def plot(report: dict, path: Path, compare: bool) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    if compare:
        for name in ("chunked", "unchunked"):
            v = np.sort(report[name]["bg_itls_ms"])
            ax.plot(v, np.linspace(0, 1, len(v)), label=name)
        ax.set_xscale("log")
        ax.set_xlabel("inter-token latency of running streams (ms)")
        ax.set_title("ITL while 4k-token prompts arrive")
    else:
        v = np.sort(report["itls_ms"])
        ax.plot(v, np.linspace(0, 1, len(v)), label="ITL")
        t = np.sort(report["ttfts_ms"])
        ax.plot(t, np.linspace(0, 1, len(t)), label="TTFT")
        ax.set_xscale("log")
        ax.set_xlabel("latency (ms)")
    ax.set_ylabel("CDF")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="server to benchmark")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="model the --compare-chunking servers load")
    ap.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare-chunking", action="store_true")
    ap.add_argument("--background-streams", type=int, default=4)
    ap.add_argument("--background-max-tokens", type=int, default=4000)
    ap.add_argument("--long-prompts", type=int, default=3)
    ap.add_argument("--long-prompt-len", type=int, default=4000)
    ap.add_argument("--long-prompt-delay", type=float, default=2.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--out", default=None, help="JSON path (PNG beside it)")
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    name = "chunking" if args.compare_chunking else f"serve-{args.dataset}"
    out = Path(args.out) if args.out else RESULTS / f"{name}.json"
    if args.compare_chunking:
        report = compare_chunking(args)
    else:
        if not args.url:
            ap.error("--url is required unless --compare-chunking")
        rng = random.Random(args.seed)
        workload = (random_dataset(args.num_prompts, args.input_len, args.output_len,
                                   args.range_ratio, rng) if args.dataset == "random" else
                    shared_prefix_dataset(args.num_prompts, args.num_prefixes, args.prefix_len,
                                          args.suffix_len, args.output_len, rng))
        results, wall = asyncio.run(run_workload(args.url, served_model(args.url), workload,
                                                 args.request_rate, args.max_concurrency,
                                                 args.seed))
        summary = summarize(results, wall)
        print_summary(args.dataset, summary)
        report = {"summary": summary, "args": vars(args),
                  "itls_ms": [x * 1000 for r in results for x in r.itls],
                  "ttfts_ms": [r.ttft * 1000 for r in results if r.ok],
                  "requests": [asdict(r) | {"itls": None} for r in results]}
    out.write_text(json.dumps(report, indent=1, default=str))
    plot(report, out.with_suffix(".png"), args.compare_chunking)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
