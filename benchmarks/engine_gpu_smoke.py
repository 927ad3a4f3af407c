"""The engine end to end on a GPU: start-up (load + warm-up), greedy agreement of the
Triton and torch attention backends in bf16, and decode throughput by batch size.

The model is a random Llama-shaped checkpoint written on the spot (no hub access on
the GPU machine), by default about 1B parameters with Llama-3's head layout (32 query
heads, 8 KV heads, head dim 64). With random weights greedy tokens are near-ties more
often than with a trained model, so the backends' agreement is reported, not asserted.

    python benchmarks/engine_gpu_smoke.py --out results/engine_gpu.json
    python benchmarks/engine_gpu_smoke.py --smoke   # CPU, tiny model, fp32: the script runs
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch


def write_checkpoint(out: Path, smoke: bool) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    size = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2) if smoke else
            dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8))
    config = LlamaConfig(vocab_size=32000, max_position_embeddings=4096, rope_theta=500000.0,
                         torch_dtype="bfloat16", **size)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16 if not smoke else torch.float32)
    model.save_pretrained(out)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(32000)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2").save_pretrained(out)
    return out


def build(path: Path, backend: str, dtype: str, device: str):
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(path), device=device, dtype=dtype,
                                    attention_backend=backend,
                                    kv_cache_memory=None if device == "cuda" else 64 << 20))
    t1 = time.perf_counter()
    engine.warm_up()
    return engine, {"load_s": t1 - t0, "warm_up_s": time.perf_counter() - t1}


def greedy(engine, prompts, max_tokens: int) -> list[list[int]]:
    from llmserve import SamplingParams
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                 ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [r.sequences[0].output_token_ids for r in reqs]


def decode_throughput(engine, batch: int, prompt_len: int, max_tokens: int) -> float:
    rng = random.Random(batch)
    prompts = [[rng.randrange(3, 32000) for _ in range(prompt_len)] for _ in range(batch)]
    greedy(engine, prompts[:1], 2)  # nothing cold
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = greedy(engine, prompts, max_tokens)
    return sum(map(len, outs)) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, fp32")
    ap.add_argument("--out", default="benchmarks/results/engine_gpu.json")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --smoke to exercise the script)")
        return 0
    device, dtype = ("cpu", "float32") if args.smoke else ("cuda", "bfloat16")
    results: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(results, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "model", args.smoke)
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(8, 600))]
                   for _ in range(8)]
        tokens = {}
        for backend in ("triton", "torch"):
            try:
                engine, startup = build(path, backend, dtype, device)
                results[f"{backend}_startup"] = startup
                tokens[backend] = greedy(engine, prompts, 32)
                if backend == "triton":
                    results["decode_tokens_per_s"] = {
                        str(b): decode_throughput(engine, b, 128, 8 if args.smoke else 64)
                        for b in ((1, 4) if args.smoke else (1, 32, 128))}
                del engine
            except Exception as e:  # noqa: BLE001 - record and go on
                results[f"{backend}_error"] = repr(e)
            save()
        if len(tokens) == 2:
            a, b = tokens["triton"], tokens["torch"]
            first_diff = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s))
                          for s, t in zip(a, b)]
            results["backend_agreement"] = {"identical_sequences": sum(s == t for s, t in
                                                                       zip(a, b)),
                                            "sequences": len(a),
                                            "first_difference_at": first_diff}
        save()
    print(json.dumps(results, indent=2))
    return 0 if "triton_error" not in results and "torch_error" not in results else 1


if __name__ == "__main__":
    raise SystemExit(main())
