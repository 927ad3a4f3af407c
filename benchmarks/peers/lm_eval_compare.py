"""A real client: lm-evaluation-harness against `llmserve serve`, checked against
lm-eval's own transformers backend on the same model and the same task.

Starts `llmserve serve` (float32) on loopback, then runs lm-eval twice on the
multiple-choice task the repository ships (benchmarks/data/lm_eval: a YAML task and
40 hand-written questions, nothing downloaded):

  * ``--model local-completions``: every choice is one /v1/completions request with
    ``echo: true, logprobs: 1, max_tokens: 1`` and the prompt as token ids, tokenized
    by lm-eval with the model's own Hugging Face tokenizer;
  * ``--model hf``: the same checkpoint directory loaded by transformers in float32.

Both runs log their samples (--log_samples); the script compares the accuracies and
every per-choice log-likelihood, prints the largest absolute difference and the
ratio of the wall times, writes a JSON summary under benchmarks/results/, and exits 1
when a log-likelihood differs by more than --tol (1e-3) or an accuracy differs.

Needs lm-eval (``pip install "lm-eval[api,hf]"``, 0.4.x), which the test extra does
not pull; --lm-eval-python runs it from another environment.

    python benchmarks/peers/lm_eval_compare.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.paths import DATA, RESULTS, ROOT
from benchmarks.lib.server import served_model
from llmserve.entrypoints.launcher import ServerProcess
from llmserve.model_executor.model_loader.sources import resolve_model

TASK_DIR = DATA / "lm_eval"
TASK = "llmserve_facts"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="what `llmserve serve --model` takes (built-in name, directory, ...)")
    p.add_argument("--device", default="cpu", help="the hf backend's device")
    p.add_argument("--tol", type=float, default=1e-3,
                   help="largest accepted |log-likelihood difference| per choice")
    p.add_argument("--lm-eval-python", default=sys.executable,
                   help="the Python that has lm-eval installed")
    p.add_argument("--batch-size", type=int, default=1,
                   help="prompts per /v1/completions request (local-completions only)")
    p.add_argument("--num-concurrent", type=int, default=1,
                   help="requests in flight at once, so the server batches them "
                        "(local-completions only)")
    p.add_argument("--url", help="an already running llmserve (float32) instead of "
                                 "starting one")
    p.add_argument("--out", type=Path, default=RESULTS / "lm_eval")
    return p.parse_args()


# --- running lm-eval ---------------------------------------------------------------------
def require_lm_eval(python: str) -> None:
    """Say how to get lm-eval before a server starts, not after a traceback."""
    probe = subprocess.run([python, "-c", "import lm_eval, accelerate, tenacity"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        sys.exit(f"{python} cannot run lm-eval ({probe.stderr.strip().splitlines()[-1]}); "
                 f'install it with: {python} -m pip install "lm-eval[api,hf]>=0.4,<0.5", '
                 f"or pass --lm-eval-python")


def run_lm_eval(python: str, backend: str, model_args: list[str], out: Path,
                batch_size: int, extra: list[str]) -> tuple[dict, list[dict], float]:
    """One lm-eval CLI run from the repository root (the task's data_files path is
    relative to it). Returns (results json, samples, wall seconds)."""
    cmd = [python, "-m", "lm_eval", "run", "--model", backend, "--model_args", *model_args,
           "--tasks", TASK, "--include_path", str(TASK_DIR), "--batch_size", str(batch_size),
           "--output_path", str(out), "--log_samples", *extra]
    # Offline: the task's data is a local JSONL and the model a local directory.
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    wall = time.perf_counter() - t0
    return read_outputs(out) + (wall,)


def read_outputs(out: Path) -> tuple[dict, list[dict]]:
    """lm-eval writes results_<time>.json and samples_<task>_<time>.jsonl under a
    folder named after the model; the run's own folder holds exactly one of each."""
    results = sorted(out.rglob("results_*.json"))
    samples = sorted(out.rglob(f"samples_{TASK}_*.jsonl"))
    if len(results) != 1 or len(samples) != 1:
        raise RuntimeError(f"{out}: expected one results and one samples file, found "
                           f"{[p.name for p in results + samples]}")
    rows = [json.loads(line) for line in samples[0].read_text().splitlines() if line]
    return json.loads(results[0].read_text()), rows



def run_against_server(args, url: str, model_dir: Path, out: Path):
    model_args = [f"model={served_model(url)}", f"base_url={url}/v1/completions",
                  f"tokenizer={model_dir}", "tokenizer_backend=huggingface",
                  "tokenized_requests=True", f"num_concurrent={args.num_concurrent}",
                  "max_retries=1"]
    return run_lm_eval(args.lm_eval_python, "local-completions", model_args, out,
                       args.batch_size, [])


def run_hf(args, model_dir: Path, out: Path):
    # Batch 1: the reference scores each choice alone, no padding in its forward pass.
    return run_lm_eval(args.lm_eval_python, "hf",
                       [f"pretrained={model_dir}", "dtype=float32"], out, 1,
                       ["--device", args.device])


# --- comparing ---------------------------------------------------------------------------
def logliks(samples: list[dict]) -> dict[tuple[int, int], float]:
    """(doc_id, choice index) -> log-likelihood of that choice given the question
    (lm-eval logs it as a string in filtered_resps[choice][0])."""
    return {(s["doc_id"], i): float(resp[0])
            for s in samples for i, resp in enumerate(s["filtered_resps"])}


def greedy(samples: list[dict]) -> dict[tuple[int, int], bool]:
    """Whether each choice is the greedy continuation: from top_logprobs on the server
    side, from the argmax of the logits on the hf side."""
    return {(s["doc_id"], i): str(resp[1]) == "True"
            for s in samples for i, resp in enumerate(s["filtered_resps"])}


def compare(server: tuple, hf: tuple, tol: float) -> dict:
    (res_s, samp_s, wall_s), (res_h, samp_h, wall_h) = server, hf
    ll_s, ll_h = logliks(samp_s), logliks(samp_h)
    if ll_s.keys() != ll_h.keys():
        raise RuntimeError(f"the runs scored different items: {len(ll_s)} vs {len(ll_h)}")
    diffs = {k: abs(ll_s[k] - ll_h[k]) for k in ll_h}
    worst = max(diffs, key=diffs.get)
    g_s, g_h = greedy(samp_s), greedy(samp_h)
    acc_s, acc_h = res_s["results"][TASK], res_h["results"][TASK]
    return {
        "docs": len(samp_h), "choices": len(ll_h),
        "acc": {"server": acc_s["acc,none"], "hf": acc_h["acc,none"]},
        "acc_norm": {"server": acc_s["acc_norm,none"], "hf": acc_h["acc_norm,none"]},
        "max_abs_loglik_diff": diffs[worst], "worst_item": list(worst),
        "over_tol": sum(d > tol for d in diffs.values()), "tol": tol,
        "is_greedy_disagreements": sum(g_s[k] != g_h[k] for k in g_h),
        "wall_s": {"server": wall_s, "hf": wall_h, "ratio_server_over_hf": wall_s / wall_h},
        "eval_s": {"server": res_s.get("total_evaluation_time_seconds"),
                   "hf": res_h.get("total_evaluation_time_seconds")},
        "lm_eval_version": res_h.get("lm_eval_version"),
    }


def report(summary: dict) -> bool:
    s = summary
    print(f"\n{TASK}: {s['docs']} questions, {s['choices']} choices scored both ways")
    for metric in ("acc", "acc_norm"):
        print(f"  {metric:9s} llmserve (local-completions) {s[metric]['server']:.4f}   "
              f"hf {s[metric]['hf']:.4f}")
    print(f"  max |delta loglik| {s['max_abs_loglik_diff']:.3g} (doc, choice) "
          f"{tuple(s['worst_item'])}; over {s['tol']:g}: {s['over_tol']}")
    print(f"  is_greedy disagreements (informational): {s['is_greedy_disagreements']}")
    w, e = s["wall_s"], s["eval_s"]
    print(f"  wall (lm-eval process): local-completions {w['server']:.1f} s, hf "
          f"{w['hf']:.1f} s, ratio {w['ratio_server_over_hf']:.2f}; lm-eval's own "
          f"evaluation time {float(e['server']):.1f} s vs {float(e['hf']):.1f} s")
    ok = (s["over_tol"] == 0 and s["acc"]["server"] == s["acc"]["hf"]
          and s["acc_norm"]["server"] == s["acc_norm"]["hf"])
    print("  PASS" if ok else "  FAIL")
    return ok


def main() -> int:
    args = parse_args()
    require_lm_eval(args.lm_eval_python)
    model_dir = resolve_model(args.model)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out / stamp
    server = None
    if args.url is None:
        server = ServerProcess(["serve", "--model", args.model, "--dtype", "float32",
                                "--log-level", "WARNING"], "127.0.0.1")
    try:
        served = run_against_server(args, args.url or server.url, model_dir,
                                    out / "local-completions")
    finally:
        if server is not None:
            server.stop()
    hf = run_hf(args, model_dir, out / "hf")
    summary = compare(served, hf, args.tol)
    summary["local_completions"] = {"batch_size": args.batch_size,
                                    "num_concurrent": args.num_concurrent}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out / 'summary.json'}")
    return 0 if report(summary) else 1


if __name__ == "__main__":
    sys.exit(main())
