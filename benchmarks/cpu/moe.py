"""A mixture-of-experts model's CPU decode speed against a dense model of equal active
parameters, in one run.

Two random checkpoints of the same attention and depth, written on the spot:

- ``moe``: Qwen3-MoE-shaped, 8 experts of ``--expert-rows`` rows, top-2 per token;
- ``dense``: Qwen3-shaped, one MLP of 2 x ``--expert-rows`` rows: the parameters one
  token of the MoE model uses.

For each batch size, the engine decodes ``--steps`` steps of ``batch`` sequences with
``--context``-token prompts; tokens/s of each and their ratio (MoE / dense) are
printed, alternating the two models over ``--rounds`` rounds (the median counts).
At batch 1 a step reads two experts a layer, as the dense model reads its one MLP:
a MoE whose cost follows its active parameters runs near 1.0x (target >= 0.7). With
more sequences more experts are chosen, so the MoE reads more weights a step than the
dense model, up to all 8 experts (its total parameters): that ratio is reported too.

    python benchmarks/cpu/moe.py                      # default dtype (bf16 where native)
    python benchmarks/cpu/moe.py --batches 1 8 32 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.paths import RESULTS
from benchmarks.lib.random_checkpoints import write_word_tokenizer
from llmserve import SamplingParams
from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine

VOCAB = 32000


def write_models(root: Path, hidden: int, layers: int, expert_rows: int) -> dict[str, Path]:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                  head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.02)
    shapes = {
        "moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**common, intermediate_size=2 * expert_rows,
                                                    moe_intermediate_size=expert_rows,
                                                    num_experts=8, num_experts_per_tok=2,
                                                    norm_topk_prob=True)),
        "dense": (Qwen3ForCausalLM, Qwen3Config(**common, intermediate_size=2 * expert_rows)),
    }
    paths = {}
    for name, (cls, config) in shapes.items():
        torch.manual_seed(0)
        out = root / name
        cls(config).save_pretrained(out)
        write_word_tokenizer(out, VOCAB)
        paths[name] = out
    return paths


def decode_tokens_per_s(engine: LLMEngine, batch: int, context: int, steps: int) -> float:
    rng = random.Random(batch)
    for _ in range(batch):
        engine.add_request([rng.randrange(3, VOCAB) for _ in range(context)],
                           SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_output_tokens == 0
                                          for s in engine.scheduler.running):
        engine.step()  # prefills
    engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    for request_id in list(engine.requests):
        engine.abort(request_id)
    return batch * steps / elapsed


def count_params(path: Path) -> dict:
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(path)
    mlp = 3 * c.hidden_size * (getattr(c, "moe_intermediate_size", 0) or c.intermediate_size)
    experts = getattr(c, "num_experts", 1)
    active = getattr(c, "num_experts_per_tok", 1)
    return {"mlp_total": mlp * experts * c.num_hidden_layers,
            "mlp_active_per_token": mlp * active * c.num_hidden_layers}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--expert-rows", type=int, default=768)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--out", default=str(RESULTS / "moe.json"))
    args = ap.parse_args()
    results: dict = {"args": vars(args), "batches": {}}
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_models(Path(tmp), args.hidden, args.layers, args.expert_rows)
        results["params"] = {name: count_params(p) for name, p in paths.items()}
        engines = {name: LLMEngine(EngineConfig(model=str(p), dtype=args.dtype,
                                                quantization=args.quantization,
                                                kv_cache_memory=256 << 20))
                   for name, p in paths.items()}
        results["dtype"] = str(engines["moe"].config.dtype)
        for batch in args.batches:
            runs = {"moe": [], "dense": []}
            for _ in range(args.rounds):  # alternating: drift hits both alike
                for name in ("dense", "moe"):
                    runs[name].append(decode_tokens_per_s(engines[name], batch, args.context,
                                                          args.steps))
            med = {name: statistics.median(v) for name, v in runs.items()}
            ratio = med["moe"] / med["dense"]
            results["batches"][batch] = {"tokens_per_s": med, "runs": runs, "ratio": ratio}
            print(f"batch {batch:3d}: MoE {med['moe']:8.1f} tok/s  dense (equal active) "
                  f"{med['dense']:8.1f} tok/s  ratio {ratio:.2f}"
                  + ("  (target >= 0.7)" if batch == 1 else ""))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results["params"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
