"""CUDA graphs on by default: does every model family capture, and decode as it does
eagerly?

For each family the engine serves (Llama, Qwen2, Qwen3, Mistral with a sliding window,
Phi-3, Gemma 2 and 3 with their soft caps and sliding layers, Mixtral and Qwen3-MoE
through the grouped Triton expert kernel, gpt-oss), a small random checkpoint is written
with transformers and served twice in bf16: by default (CUDA graphs where they apply)
and with ``--no-cuda-graphs``. Reported per family: whether graphs were captured (gpt-oss
loops over its experts on the host, so the default leaves them off and an explicit
``--cuda-graphs`` must be refused), the greedy tokens of 8 prompts (8-300 tokens, past
the sliding windows) with ``lib/greedy_agreement.compare``'s verdict on each difference
(a tie within the two paths' rounding noise, or not), and the decode step time at batch 8
both ways.

    python benchmarks/gpu/gpu_graph_families.py --out results/gpu_graph_families.json
    python benchmarks/gpu/gpu_graph_families.py --smoke   # CPU: two tiny families, no capture

``--smoke`` runs on the CPU under Triton's interpreter, where graphs are refused: it
attaches them without capture (the static, padded replay path), as the tests do.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # --smoke: the Triton kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.decode_step import decode_step_ms
from benchmarks.lib.device_memory import recorded_engines, release_device_memory
from benchmarks.lib.greedy_agreement import compare, greedy_with_margins
from benchmarks.lib.model_families import FAMILIES, write_family
from benchmarks.lib.paths import RESULTS
from benchmarks.lib.verdicts import record

SMOKE_FAMILIES = ("llama", "mixtral")


def build(path: Path, cuda_graphs: bool | None, smoke: bool):
    """An engine with ``cuda_graphs`` as given (None: the default), warmed up (every
    bucket captured); the smoke attaches the graphs without capture."""
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    common = dict(model=str(path), attention_backend="triton", max_num_seqs=16,
                  enable_prefix_caching=False)
    t0 = time.perf_counter()
    if smoke:
        from llmserve.worker.cuda_graphs import uncapturable
        from llmserve.worker.step_buffers import enable_fast_path
        engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=256,
                                        kv_cache_memory=16 << 20, **common))
        if cuda_graphs is not False and uncapturable(engine.runner.model) is None:
            enable_fast_path(engine.runner, engine.max_model_len, graph_sizes=[1, 2, 4],
                             capture=False)
    else:
        engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", max_model_len=2048,
                                        cuda_graphs=cuda_graphs, **common))
    t1 = time.perf_counter()
    engine.warm_up()
    graphs = engine.runner.graphs
    return engine, {"load_s": round(t1 - t0, 2), "warm_up_s": round(time.perf_counter() - t1, 2),
                    "graphs": None if graphs is None else sorted(graphs.graphs or graphs.sizes)}


def explicit_refusal(path: Path) -> str | None:
    """The error an explicit ``--cuda-graphs`` gets on a model that cannot be captured
    (None: it started)."""
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    try:
        engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16",
                                        max_model_len=2048, max_num_seqs=16, cuda_graphs=True))
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        return repr(e)[:300]
    engine.shutdown()
    return None


def measure(family: str, path: Path, prompts, smoke: bool) -> dict:
    res: dict = {}
    tokens = {}
    for name, graphs in (("default", None), ("eager", False)):
        with recorded_engines(res, name) as engines:
            engine, res[name] = build(path, graphs, smoke)
            engines.append(engine)
            tokens[name] = greedy_with_margins(engine, prompts, 2 if smoke else 32)
            if not smoke:
                res[name]["decode_step_ms_b8"] = round(decode_step_ms(engine, 8, 10, 256), 3)
    if len(tokens) == 2:
        res["greedy"] = compare(tokens["eager"], tokens["default"])
        res["greedy"].pop("differences")
    if not smoke and res.get("default", {}).get("graphs") is None:
        res["explicit_cuda_graphs"] = explicit_refusal(path)
        release_device_memory()
    eager, default = (res.get(k, {}).get("decode_step_ms_b8") for k in ("eager", "default"))
    if eager and default:
        res["speedup_b8"] = round(eager / default, 2)
    return res


def verdict(family: str, res: dict, smoke: bool) -> str | None:
    """What is wrong with a family's result, or None (the smoke does not ask for the
    explicit refusal)."""
    if any("error" in res.get(k, {}) for k in ("default", "eager")):
        return "an engine failed"
    captured = res["default"]["graphs"] is not None
    if family == "gpt_oss":  # host-side expert loop: default off, explicit refused
        refusal = res.get("explicit_cuda_graphs") or ""
        if captured or (not smoke and not ("ValueError" in refusal
                                           and "--no-cuda-graphs" in refusal)):
            return "gpt-oss should run eagerly by default and refuse --cuda-graphs"
        return None
    if not captured:
        return "graphs not captured"
    if not res["greedy"]["all_within_noise"]:
        return "a greedy difference outside the rounding noise"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="two tiny families on the CPU, fp32")
    ap.add_argument("--families", nargs="+", choices=list(FAMILIES))
    ap.add_argument("--out", default=str(RESULTS / "gpu_graph_families.json"))
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --smoke to exercise the script)")
        return 0
    families = args.families or (SMOKE_FAMILIES if args.smoke else list(FAMILIES))
    rng = random.Random(0)
    longest = 24 if args.smoke else 300
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(8, longest))]
               for _ in range(2 if args.smoke else 8)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results, failed = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            t0 = time.perf_counter()
            try:
                path = write_family(Path(tmp) / family, family, args.smoke)
                res = measure(family, path, prompts, args.smoke)
            except Exception as e:  # noqa: BLE001 - record and go on
                res = {"error": repr(e)[:500]}
            res["seconds"] = round(time.perf_counter() - t0, 1)
            problem = ("checkpoint not written" if "error" in res
                       else verdict(family, res, args.smoke))
            record(results, failed, family, res, problem, out)
    print("failed:" if failed else "every family ok", *failed)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
