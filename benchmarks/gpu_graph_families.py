"""CUDA graphs on by default: does every model family capture, and decode as it does
eagerly?

For each family the engine serves (Llama, Qwen2, Qwen3, Mistral with a sliding window,
Phi-3, Gemma 2 and 3 with their soft caps and sliding layers, Mixtral and Qwen3-MoE
through the grouped Triton expert kernel, gpt-oss), a small random checkpoint is written
with transformers and served twice in bf16: by default (CUDA graphs where they apply)
and with ``--no-cuda-graphs``. Reported per family: whether graphs were captured (gpt-oss
loops over its experts on the host, so the default leaves them off and an explicit
``--cuda-graphs`` must be refused), the greedy tokens of 8 prompts (8-300 tokens, past
the sliding windows) with ``gpu_greedy_margins.compare``'s verdict on each difference
(a tie within the two paths' rounding noise, or not), and the decode step time at batch 8
both ways.

    python benchmarks/gpu_graph_families.py --out results/gpu_graph_families.json
    python benchmarks/gpu_graph_families.py --smoke   # CPU: two tiny families, no capture

``--smoke`` runs on the CPU under Triton's interpreter, where graphs are refused: it
attaches them without capture (the static, padded replay path), as the tests do.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # --smoke: the Triton kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_fast_path import decode_step_ms  # noqa: E402
from gpu_greedy_margins import compare, generate  # noqa: E402
from random_llama import (  # noqa: E402
    EOS_ID,
    recorded_engines,
    release_device_memory,
    save_random_model,
)

WINDOW = 128  # the sliding layers' window: shorter than the longest prompts
COMMON = dict(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=0.05,
              bos_token_id=1, eos_token_id=EOS_ID, tie_word_embeddings=False)
SLIDING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2)
# family -> (transformers config class, model class, config fields beyond COMMON)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=1000000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=None, pad_token_id=0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(SLIDING, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                    query_pre_attn_scalar=64, pad_token_id=0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(SLIDING, query_pre_attn_scalar=64, pad_token_id=0,
                    rope_local_base_freq=10000.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=512)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                       norm_topk_prob=True)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(SLIDING, num_local_experts=4, num_experts_per_tok=2,
                     intermediate_size=512, swiglu_limit=7.0)),
}
SMOKE_FAMILIES = ("llama", "mixtral")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def write_family(out: Path, family: str, smoke: bool) -> Path:
    """A random ``family`` checkpoint (bf16 on a GPU) with the word-level tokenizer."""
    import transformers
    config_class, model_class, extra = FAMILIES[family]
    fields = dict(COMMON, **extra)
    if smoke:
        fields.update(TINY, max_position_embeddings=512)
        if "layer_types" in fields:
            fields["layer_types"] = fields["layer_types"][:2]
        if "intermediate_size" in extra:
            fields["intermediate_size"] = 64
    config = getattr(transformers, config_class)(**fields)
    return save_random_model(out, getattr(transformers, model_class), config)


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
            tokens[name] = generate(engine, prompts, 2 if smoke else 32)
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


def record(results: dict, failed: list, name: str, res: dict, problem: str | None,
           out: Path) -> None:
    """Keep ``name``'s result with its verdict, print it and rewrite ``out`` (a run cut
    short keeps what it measured)."""
    res["verdict"] = problem or "ok"
    if problem:
        failed.append(name)
    results[name] = res
    print(name, json.dumps(res), flush=True)
    out.write_text(json.dumps(results, indent=2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="two tiny families on the CPU, fp32")
    ap.add_argument("--families", nargs="+", choices=list(FAMILIES))
    ap.add_argument("--out", default="benchmarks/results/gpu_graph_families.json")
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
