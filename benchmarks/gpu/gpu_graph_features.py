"""CUDA graphs on by default, with the engine features whose steps they skip: speculative
decoding (its verify steps hold several tokens a sequence, so they run eagerly) and
multi-LoRA (a step with an adapter runs eagerly). Does each still decode as it does
with ``--no-cuda-graphs``, with the graphs replayed for the steps they cover?

On the Llama family of ``lib/model_families.py`` (a random 4-layer checkpoint, bf16),
each feature is served twice, by default and eagerly:

- ``speculative``: a draft model (the same checkpoint, so drafts are accepted but for
  ties) of 3 tokens, off above 4 running sequences (``disable_by_batch_size``): 8
  sequences decode without drafts (graphs) until 4 of them finish, then with drafts
  (verify steps, eager);
- ``lora``: a random rank-8 PEFT adapter on every projection (``lib/lora_adapter.py``'s, PEFT's
  file layout), 4 prompts under it and 4 on the base model, in separate batches.

Reported: greedy agreement (``lib/greedy_agreement.compare``: differences must be ties
within the rounding noise), how many steps replayed a graph, the draft tokens verified
and accepted (a random model rarely continues the phrase: the drafts are there to make
verify steps, not to be accepted), and whether the adapter changed the tokens.

    python benchmarks/gpu/gpu_graph_features.py --out results/gpu_graph_features.json
    python benchmarks/gpu/gpu_graph_features.py --smoke   # CPU: the plumbing, no capture
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

from benchmarks.lib.device_memory import recorded_engines
from benchmarks.lib.greedy_agreement import compare, run_to_end, with_margins
from benchmarks.lib.lora_adapter import write_adapter
from benchmarks.lib.model_families import write_family
from benchmarks.lib.paths import RESULTS
from benchmarks.lib.verdicts import record


def build(path: Path, graphs: bool, smoke: bool, **extra):
    """An engine by default (``graphs``) or with --no-cuda-graphs, warmed up, with a
    counter of the steps that went through ``runner.graphs``."""
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    common = dict(model=str(path), attention_backend="triton", max_num_seqs=16,
                  enable_prefix_caching=False, **extra)
    if smoke:
        from llmserve.worker.step_buffers import enable_fast_path
        engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=256,
                                        kv_cache_memory=16 << 20, **common))
        if graphs:
            enable_fast_path(engine.runner, engine.max_model_len, graph_sizes=[1, 2, 4],
                             capture=False)
    else:
        engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", max_model_len=2048,
                                        cuda_graphs=None if graphs else False, **common))
    engine.warm_up()
    replays = [0]
    if engine.runner.graphs is not None:
        real = engine.runner.graphs.run

        def counted(*args):
            replays[0] += 1
            return real(*args)
        engine.runner.graphs.run = counted
    return engine, replays


def generate(engine, batches):
    """Greedy (token, logprob, top-2 margin) lists, one batch after another: a batch is
    [(prompt, lora_request or None, max_tokens)]."""
    from llmserve import SamplingParams
    out = []
    for batch in batches:
        reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n,
                                                     ignore_eos=True, logprobs=2),
                                   lora_request=lora) for p, lora, n in batch]
        out += [with_margins(o) for o in run_to_end(engine, reqs)]
    return out


def feature_runs(name: str, path: Path, tmp: Path, smoke: bool):
    """(engine settings, batches) of one feature."""
    rng = random.Random(1)
    count, longest, tokens = (4, 24, 6) if smoke else (8, 200, 32)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(8, longest))]
               for _ in range(count)]
    if name == "speculative":
        lengths = [tokens // 3] * (count // 2) + [tokens] * (count - count // 2)
        spec = {"model": str(path), "num_speculative_tokens": 3,
                "disable_by_batch_size": count // 2}
        return {"speculative_config": spec}, [list(zip(prompts, [None] * count, lengths))]
    from transformers import AutoConfig

    from llmserve.core.lora_request import LoRARequest
    adapter_path = write_adapter(tmp / "adapter", AutoConfig.from_pretrained(path), 8, seed=7)
    adapter = LoRARequest("random", 1, str(adapter_path))
    half = prompts[:count // 2]
    settings = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
    return settings, [[(p, None, tokens) for p in half], [(p, adapter, tokens) for p in half]]


def measure(name: str, path: Path, tmp: Path, smoke: bool) -> dict:
    settings, batches = feature_runs(name, path, tmp, smoke)
    res, tokens = {}, {}
    for side, graphs in (("default", True), ("eager", False)):
        with recorded_engines(res, side) as engines:
            t0 = time.perf_counter()
            engine, replays = build(path, graphs, smoke, **settings)
            engines.append(engine)
            tokens[side] = generate(engine, batches)
            res[side] = {"graph_replays": replays[0], "seconds": round(time.perf_counter() - t0, 1)}
            if engine.spec is not None:  # verify steps (eager) and what they accepted
                res[side]["draft_tokens"] = engine.spec.num_draft_tokens
                res[side]["accepted_tokens"] = engine.spec.num_accepted_tokens
    if len(tokens) == 2:
        res["greedy"] = compare(tokens["eager"], tokens["default"])
        res["greedy"].pop("differences")
        if name == "lora":  # the adapter's sequences against the same prompts' base ones
            half = len(tokens["eager"]) // 2
            base, adapted = tokens["eager"][:half], tokens["eager"][half:]
            res["adapter_changed_tokens"] = sum(
                [t for t, _, _ in a] != [t for t, _, _ in b] for a, b in zip(base, adapted))
    return res


def verdict(res: dict) -> str | None:
    if any("error" in res.get(k, {}) for k in ("default", "eager")):
        return "an engine failed"
    if res["default"]["graph_replays"] == 0:
        return "no step replayed a graph"
    if res["eager"]["graph_replays"] != 0:
        return "--no-cuda-graphs replayed graphs"
    if not res["greedy"]["all_within_noise"]:
        return "a greedy difference outside the rounding noise"
    if res["default"].get("draft_tokens") == 0:
        return "no draft was verified"
    if res.get("adapter_changed_tokens") == 0:
        return "the adapter changed no sequence"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, fp32")
    ap.add_argument("--features", nargs="+", default=["speculative", "lora"],
                    choices=["speculative", "lora"])
    ap.add_argument("--out", default=str(RESULTS / "gpu_graph_features.json"))
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --smoke to exercise the script)")
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results, failed = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_family(Path(tmp) / "llama", "llama", args.smoke)
        for name in args.features:
            try:
                res = measure(name, path, Path(tmp), args.smoke)
                problem = verdict(res)
            except Exception as e:  # noqa: BLE001 - record and go on
                res, problem = {"error": repr(e)[:500]}, "failed"
            record(results, failed, name, res, problem, out)
    print("failed:" if failed else "every feature ok", *failed)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
