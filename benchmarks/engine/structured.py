"""Structured outputs: what a grammar costs.

1. Throughput at 32 streams (built-in model, offline engine, temperature 1): a batch
   of free requests, then the same batch with half, then all of its requests
   constrained to a JSON schema, each free request decoding as many tokens as its seed
   did under the schema. Tokens/s of each and the ratio against the free batch.
2. Compiling a schema: cold (a schema never seen) and cached, and the per-step mask
   time, for llguidance (what the engine uses) and, when installed, xgrammar
   (`pip install xgrammar`), on the same tokenizer and schema.

    python benchmarks/engine/structured.py            # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import torch

from llmserve import LLM, SamplingParams
from llmserve.core.sampling_params import StructuredOutputsParams
from llmserve.structured_output.grammar import StructuredOutputs

# A long, fixed-shape output: five objects, ~100 tokens.
SCHEMA = {
    "type": "array", "minItems": 5, "maxItems": 5,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 3, "maxLength": 10},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "role": {"enum": ["admin", "user", "guest"]}},
        "required": ["name", "age", "role"], "additionalProperties": False,
    },
}


def run_batch(llm: LLM, constrained: int, lengths: list[int], max_tokens: int) -> dict:
    """Requests 0..constrained-1 follow the schema; the others are free and decode
    exactly as many tokens as the same seed did under the schema, so every batch does
    the same work and only the grammar differs."""
    spec = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                             structured_outputs=spec) if i < constrained else
              SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
              for i, n in enumerate(lengths)]
    prompts = [f"List five people of team {i} as JSON." for i in range(len(lengths))]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    valid = sum(_parses(o.outputs[0].text) for o in outs[:constrained])
    return {"constrained": constrained, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "valid": valid,
            "lengths": [len(o.outputs[0].token_ids) for o in outs]}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def llguidance_costs(llm: LLM) -> dict:
    t0 = time.perf_counter()
    so = StructuredOutputs(llm.engine.tokenizer, llm.engine.hf_config.vocab_size,
                           llm.engine.eos_token_ids)
    setup = time.perf_counter() - t0
    fresh = dict(SCHEMA, title=uuid.uuid4().hex)  # never compiled before
    t0 = time.perf_counter()
    so.compile(StructuredOutputsParams(json=fresh))
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    so.compile(StructuredOutputsParams(json=fresh))
    cached = time.perf_counter() - t0
    m = so.matcher(StructuredOutputsParams(json=fresh))
    return {"tokenizer_setup_ms": setup * 1e3, "compile_cold_ms": cold * 1e3,
            "compile_cached_ms": cached * 1e3,
            "mask_ms": _mask_times(llm, m, lambda bm: _ll_fill(m, bm),
                                   lambda t: m.consume_token(t) and not m.is_stopped())}


def _ll_fill(matcher, bitmask):
    from llguidance.torch import fill_next_token_bitmask
    fill_next_token_bitmask(matcher, bitmask, 0)


def xgrammar_costs(llm: LLM) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    vocab = llm.engine.hf_config.vocab_size
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(llm.engine.tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    setup = time.perf_counter() - t0
    fresh = json.dumps(dict(SCHEMA, title=uuid.uuid4().hex))
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(fresh, any_whitespace=False)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile_json_schema(fresh, any_whitespace=False)
    cached = time.perf_counter() - t0
    m = xgr.GrammarMatcher(compiled)
    return {"tokenizer_setup_ms": setup * 1e3, "compile_cold_ms": cold * 1e3,
            "compile_cached_ms": cached * 1e3,
            "mask_ms": _mask_times(llm, m, lambda bm: m.fill_next_token_bitmask(bm, 0),
                                   lambda t: m.accept_token(t) and not m.is_terminated())}


def _mask_times(llm: LLM, matcher, fill, accept, steps: int = 150) -> dict:
    """Walk one valid output (greedy over the mask with random logits) and time each
    mask fill."""
    vocab = llm.engine.hf_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
        t0 = time.perf_counter()
        fill(bitmask)
        times.append(time.perf_counter() - t0)
        bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.view(-1)[:vocab].bool()
        scores = torch.rand(vocab, generator=gen).masked_fill(~allowed, -1)
        if not accept(int(scores.argmax())):
            break
    return {"mean": statistics.mean(times) * 1e3, "median": statistics.median(times) * 1e3,
            "max": max(times) * 1e3, "steps": len(times)}


def throughput_runs(llm: LLM, streams: int, max_tokens: int) -> list[dict]:
    run_batch(llm, 2, [8] * 4, 8)  # warm up
    first = run_batch(llm, streams, [max_tokens] * streams, max_tokens)  # learns lengths
    return [run_batch(llm, k, first["lengths"], max_tokens)
            for k in (0, streams // 2, streams)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--costs-only", action="store_true", help="skip the throughput runs")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    llm = LLM(args.model, max_num_seqs=args.streams)
    llm.engine.structured_outputs()  # tokenizer wrapped once, as a server does at first use
    runs = [] if args.costs_only else throughput_runs(llm, args.streams, args.max_tokens)
    base = runs[0]["tokens_per_s"] if runs else 1.0
    print(f"\n{args.streams} streams, {llm.engine.config.dtype}:")
    for r in runs:
        print(f"  {r['constrained']:3d} constrained: {r['tokens_per_s']:7.1f} tokens/s "
              f"({r['tokens']} tokens, {r['wall_s']:.1f} s)  ratio {r['tokens_per_s'] / base:.2f}"
              f"  valid JSON {r['valid']}/{r['constrained']}")
    costs = {"llguidance": llguidance_costs(llm), "xgrammar": xgrammar_costs(llm)}
    for name, c in costs.items():
        if c is None:
            print(f"  {name}: not installed")
            continue
        print(f"  {name}: tokenizer setup {c['tokenizer_setup_ms']:.0f} ms, compile cold "
              f"{c['compile_cold_ms']:.2f} ms, cached "
              f"{c['compile_cached_ms']:.3f} ms; mask over {c['mask_ms']['steps']} tokens: "
              f"median {c['mask_ms']['median']:.3f} ms, mean {c['mask_ms']['mean']:.3f} ms, "
              f"max {c['mask_ms']['max']:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "costs": costs, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
