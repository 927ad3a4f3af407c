"""Static vs continuous batching at equal p95 latency, and the step-latency cap.

Part 1 (the design's headline): Poisson arrivals swept over request rates, outputs
uniform in [--min-out, --max-out] (ignore_eos), prompts of 16-128 tokens, on the
built-in model in-process (the offline engine driven by wall-clock arrivals, so the
numbers are the scheduler's, not HTTP's). For static and continuous batching (both
with --max-num-seqs, 16 by default: the design's 16-request batches), each rate gives
a throughput and a p95 end-to-end latency; the SLO is "p95 latency <= --slo-s". The
best throughput meeting it is each mode's goodput; the ratio is printed, and a PNG of
throughput against p95 latency (one curve per mode) is written.

Part 2 (the cap): --decode-streams streams decode while long prompts keep arriving;
p95 inter-token latency of the decoding streams without and with --target-itl-ms.

    python benchmarks/engine/slo_goodput.py                    # ~20 min on 2 cores
    python benchmarks/engine/slo_goodput.py --part cap         # part 2 only, ~3 min
    python benchmarks/engine/slo_goodput.py --replot benchmarks/results/slo_goodput.json --slo-s 90
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.paths import FIGURES, RESULTS
from benchmarks.lib.percentiles import percentile
from llmserve import LLM, SamplingParams


# --- driving the engine with arrivals ------------------------------------------------------
def make_requests(n: int, rate: float, lo: int, hi: int, seed: int):
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(16, 128))]
        out.append((t, prompt, rng.randint(lo, hi)))
    return out


def drive(llm: LLM, requests) -> dict:
    """Feed (arrival s, prompt, max_tokens) at their times; per request, the arrival and
    every token's time."""
    engine = llm.engine
    pending = sorted(requests, key=lambda r: r[0])
    times: dict[str, list[float]] = {}
    arrival: dict[str, float] = {}
    steps: list[tuple[float, float | None]] = []  # (actual, predicted) seconds
    t0 = time.perf_counter()
    i = 0
    while i < len(pending) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while i < len(pending) and pending[i][0] <= now:
            at, prompt, max_tokens = pending[i]
            rid = engine.add_request(prompt, SamplingParams(
                temperature=0, max_tokens=max_tokens, ignore_eos=True)).request_id
            arrival[rid], times[rid] = at, []
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[i][0] - now))
            continue
        outs = engine.step()
        stamp = time.perf_counter() - t0
        if engine.last_step is not None:
            steps.append(engine.last_step)
        for out in outs:
            new = len(out.outputs[0].token_ids) - len(times[out.request_id])
            times[out.request_id] += [stamp] * new
    return {"arrival": arrival, "times": times, "wall": time.perf_counter() - t0,
            "steps": steps}


def summarize(run: dict) -> dict:
    e2e = [ts[-1] - run["arrival"][r] for r, ts in run["times"].items()]
    itl = [b - a for ts in run["times"].values() for a, b in zip(ts, ts[1:])]
    tokens = sum(len(ts) for ts in run["times"].values())
    first = min(run["arrival"].values())
    last = max(ts[-1] for ts in run["times"].values())
    return {"throughput": tokens / (last - first), "p95_e2e": percentile(e2e, 95),
            "p95_itl": percentile(itl, 95), "mean_itl": float(np.mean(itl)),
            "tokens": tokens}


# --- part 1 ---------------------------------------------------------------------------------
def sweep(args) -> dict:
    results = {}
    for mode in ("static", "continuous"):
        llm = LLM(args.model, batching=mode, max_num_seqs=args.max_num_seqs)
        results[mode] = []
        for rate in args.rates:
            reqs = make_requests(args.num_requests, rate, args.min_out, args.max_out, args.seed)
            s = summarize(drive(llm, reqs))
            s["rate"] = rate
            results[mode].append(s)
            print(f"  {mode:<10} rate {rate:5.2f}/s: {s['throughput']:6.1f} tokens/s, "
                  f"p95 e2e {s['p95_e2e']:6.1f} s, p95 ITL {1e3 * s['p95_itl']:6.0f} ms",
                  flush=True)
        del llm
    return results


def goodput(points: list[dict], slo_s: float) -> dict | None:
    ok = [p for p in points if p["p95_e2e"] <= slo_s]
    return max(ok, key=lambda p: p["throughput"]) if ok else None


def throughput_at(points: list[dict], p95: float) -> float | None:
    """The best throughput a mode reaches without its p95 exceeding ``p95``,
    interpolating linearly between measured rates."""
    pts = sorted(points, key=lambda p: p["p95_e2e"])
    best = None
    for a, b in zip(pts, pts[1:]):
        if a["p95_e2e"] <= p95 <= b["p95_e2e"] and b["p95_e2e"] > a["p95_e2e"]:
            f = (p95 - a["p95_e2e"]) / (b["p95_e2e"] - a["p95_e2e"])
            best = max(best or 0.0, a["throughput"] + f * (b["throughput"] - a["throughput"]))
    ok = [p["throughput"] for p in pts if p["p95_e2e"] <= p95]
    return max([best or 0.0, *ok]) if ok or best else None


def report_batching(results: dict, slo_s: float, report: dict) -> None:
    best = {m: goodput(p, slo_s) for m, p in results.items()}
    report["goodput"] = best
    for m, b in best.items():
        print(f"  {m}: goodput at p95 <= {slo_s:g} s: " + (
            f"{b['throughput']:.1f} tokens/s at {b['rate']}/s (p95 {b['p95_e2e']:.1f} s)"
            if b else "none meets the SLO"))
    if best["static"] and best["continuous"]:
        report["ratio"] = best["continuous"]["throughput"] / best["static"]["throughput"]
        print(f"  continuous / static at the SLO: {report['ratio']:.2f}x")
    # At equal p95: for each static point, continuous's throughput at that p95.
    report["equal_p95"] = []
    for p in results["static"]:
        cont = throughput_at(results["continuous"], p["p95_e2e"])
        if cont:
            report["equal_p95"].append({"p95_e2e": p["p95_e2e"], "static": p["throughput"],
                                        "continuous": cont, "ratio": cont / p["throughput"]})
            print(f"  at p95 {p['p95_e2e']:6.1f} s: static {p['throughput']:6.1f}, continuous "
                  f"{cont:6.1f} tokens/s = {cont / p['throughput']:.2f}x")


def plot(results: dict, slo_s: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, points in results.items():
        ax.plot([p["p95_e2e"] for p in points], [p["throughput"] for p in points], "o-",
                label=f"{mode} batching")
        for p in points:
            ax.annotate(f"{p['rate']:g}/s", (p["p95_e2e"], p["throughput"]), fontsize=7,
                        textcoords="offset points", xytext=(4, -8))
    ax.axvline(slo_s, color="grey", linestyle="--", linewidth=1, label=f"SLO p95 {slo_s:g} s")
    ax.set_xlabel("p95 end-to-end latency (s)")
    ax.set_ylabel("throughput (output tokens/s)")
    ax.set_title("Static vs continuous batching (built-in model, CPU)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


# --- part 2 ---------------------------------------------------------------------------------
def cap_run(args, target_ms: float | None) -> dict:
    llm = LLM(args.model, target_itl_ms=target_ms)
    rng = random.Random(args.seed)
    # Streams decoding from t=0; long prompts every --long-every s while they run.
    reqs = [(0.01 * k, [rng.randrange(100, 40000) for _ in range(32)], args.decode_tokens)
            for k in range(args.decode_streams)]
    t = 1.0
    while t < args.long_until:
        reqs.append((t, [rng.randrange(100, 40000) for _ in range(args.long_prompt)], 4))
        t += args.long_every
    run = drive(llm, reqs)
    decoders = sorted(run["times"], key=lambda r: run["arrival"][r])[:args.decode_streams]
    itl = [b - a for r in decoders for a, b in zip(run["times"][r], run["times"][r][1:])]
    model = llm.engine.scheduler.cost_model
    predicted = [(a, p) for a, p in run["steps"] if p is not None]
    errors = [a / p - 1 for a, p in predicted]
    over = [a for a, _ in predicted if target_ms and a * 1e3 > target_ms]
    return {"target_ms": target_ms, "p95_itl_ms": 1e3 * percentile(itl, 95),
            "mean_itl_ms": 1e3 * float(np.mean(itl)), "max_itl_ms": 1e3 * max(itl),
            "cost_model": model.coef.tolist(), "steps": len(run["steps"]),
            "prediction_error_p50": percentile(np.abs(errors), 50),
            "prediction_error_p90": percentile(np.abs(errors), 90),
            "steps_over_target": len(over)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["all", "batching", "cap"], default="all")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                    default=[0.15, 0.3, 0.6, 1.2])
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--min-out", type=int, default=20)
    ap.add_argument("--max-out", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--slo-s", type=float, default=120.0, help="p95 end-to-end latency SLO")
    ap.add_argument("--target-itl-ms", type=float, default=100.0)
    ap.add_argument("--decode-streams", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=200)
    ap.add_argument("--long-prompt", type=int, default=1500)
    ap.add_argument("--long-every", type=float, default=2.0)
    ap.add_argument("--long-until", type=float, default=12.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(RESULTS / "slo_goodput.json"))
    ap.add_argument("--replot", default=None,
                    help="a previous run's JSON: recompute goodput for --slo-s and redraw")
    args = ap.parse_args()
    if args.replot:
        report = json.loads(Path(args.replot).read_text())
        report_batching(report["batching"], args.slo_s, report)
        plot(report["batching"], args.slo_s, FIGURES / "static_vs_continuous.png")
        Path(args.replot).write_text(json.dumps(report, indent=1))
        return
    report: dict = {"args": vars(args)}
    if args.part in ("all", "batching"):
        print(f"Part 1: {args.num_requests} requests per rate, outputs {args.min_out}-"
              f"{args.max_out}, max_num_seqs {args.max_num_seqs}, SLO p95 e2e <= {args.slo_s} s")
        results = sweep(args)
        report["batching"] = results
        report_batching(results, args.slo_s, report)
        plot(results, args.slo_s, FIGURES / "static_vs_continuous.png")
        print(f"  wrote {FIGURES / 'static_vs_continuous.png'}")
    if args.part in ("all", "cap"):
        print(f"Part 2: {args.decode_streams} decoding streams, a {args.long_prompt}-token "
              f"prompt every {args.long_every} s")
        caps = [cap_run(args, None), cap_run(args, args.target_itl_ms)]
        report["cap"] = caps
        for c in caps:
            label = f"target {c['target_ms']:g} ms" if c["target_ms"] else "no target"
            print(f"  {label:<16} p95 ITL {c['p95_itl_ms']:6.1f} ms, mean {c['mean_itl_ms']:6.1f}"
                  f" ms, max {c['max_itl_ms']:6.1f} ms; step prediction error p50 "
                  f"{100 * c['prediction_error_p50']:.0f} %, p90 "
                  f"{100 * c['prediction_error_p90']:.0f} %; {c['steps_over_target']} of "
                  f"{c['steps']} steps over the target")
        print(f"  p95 ITL / target with the cap: "
              f"{caps[1]['p95_itl_ms'] / args.target_itl_ms:.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
