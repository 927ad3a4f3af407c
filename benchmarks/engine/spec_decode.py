"""Speculative decoding (n-gram / prompt lookup): tokens/s with and without, same run.

Two engines of the built-in model (default dtype) in one process, alternating request by
request so that both see the same machine state, each warmed up first on every
workload (a step shape's first run pays one-off costs: oneDNN primitives, first-touch
pages). Greedy, so both produce the same
tokens (checked). Single stream on copying workloads (repeat this text, edit this code,
answer with quotes) and on plain chat; then 32 streams at once.

    python benchmarks/engine/spec_decode.py [--rounds 2] [--max-tokens 128]
    python benchmarks/engine/spec_decode.py --draft-layers 8   # a draft model instead of n-gram

``--draft-layers N``: the draft is the built-in model cut to its first N layers (same
tokenizer, no training: a crude early-exit draft, since no smaller model of the family
ships here); it shows what a draft model's passes cost against what they save.

``--ceiling`` only decodes each prompt greedily once and replays the n-gram proposer
over the outputs: greedy tokens do not depend on the drafts, so this gives exactly the
tokens each verification step would yield, i.e. the speed-up if verifying k drafts cost
no more than a plain decode step (an upper bound for that proposer on that model):

    python benchmarks/engine/spec_decode.py --ceiling

``--temperature T`` samples (top_p 0.95, seeded per request, so both engines still
give the same tokens). With a draft model it also runs a third engine whose drafts are
the draft model's argmax (as before drafts were coupled to the target's draws,
draft_model.py) and prints both acceptance rates:

    python benchmarks/engine/spec_decode.py --draft-layers 16 --temperature 0.8
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from llmserve import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}

PARAGRAPH = (
    "The paged KV cache splits each sequence's keys and values into fixed-size blocks, "
    "allocated on demand, so that memory waste stays under one block per sequence. A "
    "block table maps each sequence to its blocks, and full blocks are keyed by a hash "
    "chained over their tokens, so that a new request can reuse the blocks of any earlier "
    "request that shares its prefix. When blocks run out, the least urgent request is "
    "preempted: swapped to CPU memory, or dropped and recomputed later.")
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal = subtotal + item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''
WORKLOADS = {
    "repeat": [f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
               f"Copy this paragraph out again, unchanged:\n\n{PARAGRAPH}"],
    "edit_code": [f"Rename the variable `subtotal` to `net` in this code and show the "
                  f"whole code:\n\n```python\n{CODE}```",
                  f"Add type hints to this code and show the whole code:\n\n"
                  f"```python\n{CODE}```"],
    "quote": [f"Passage: {PARAGRAPH}\n\nQuoting the passage's exact sentences, explain "
              f"what happens when blocks run out and how prefixes are reused.",
              f"Passage: {PARAGRAPH}\n\nWhat does the block table do? Answer with quotes "
              f"from the passage."],
    "chat": ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
             "What are three good habits for staying healthy? Explain each briefly."],
}


TEMPERATURE = 0.0  # --temperature


def chat(llm: LLM, prompts: list[str], max_tokens: int):
    params = [SamplingParams(temperature=TEMPERATURE, top_p=0.95 if TEMPERATURE else 1.0,
                             seed=i if TEMPERATURE else None, max_tokens=max_tokens)
              for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    return time.perf_counter() - t0, outs


def run(base: LLM, spec: LLM, prompts: list[str], rounds: int, max_tokens: int,
        streams: int = 1) -> dict:
    """Alternating base/spec; single stream runs one prompt at a time."""
    secs = {"base": 0.0, "spec": 0.0}
    tokens = {"base": 0, "spec": 0}
    s = spec.engine.spec
    drafted, accepted = s.num_draft_tokens, s.num_accepted_tokens
    batches = [[p] for p in prompts] if streams == 1 else [prompts]
    for _ in range(rounds):
        for batch in batches:
            texts = {}
            for name, llm in (("base", base), ("spec", spec)):
                dt, outs = chat(llm, batch, max_tokens)
                secs[name] += dt
                tokens[name] += sum(len(o.outputs[0].token_ids) for o in outs)
                texts[name] = [o.outputs[0].token_ids for o in outs]
            if texts["base"] != texts["spec"]:
                print("  note: outputs differ (a near-tie in bf16 flipped with batch shape)")
    rate = {k: tokens[k] / secs[k] for k in secs}
    drafts = s.num_draft_tokens - drafted
    return {"tok_s_base": rate["base"], "tok_s_spec": rate["spec"],
            "speedup": rate["spec"] / rate["base"],
            "acceptance_rate": (s.num_accepted_tokens - accepted) / drafts if drafts else 0.0,
            "tokens": tokens["spec"]}


def argmax_drafts(logits, positions, grammar_rows=None, bitmask=None):
    """A draft model's argmax for every request (no grammar here): uncoupled drafts."""
    return argparse.Namespace(token_ids=logits.argmax(dim=-1).tolist())


def truncated_builtin(model: str, layers: int, out: Path) -> Path:
    """``model`` cut to its first ``layers`` decoder layers, saved at ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmserve.model_executor.model_loader.sources import resolve_model
    src = resolve_model(model)
    shutil.copytree(src, out, dirs_exist_ok=True)
    m = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.bfloat16)
    m.model.layers = m.model.layers[:layers]
    m.config.num_hidden_layers = layers
    m.save_pretrained(out)
    return out


def ngram_ceiling(llm: LLM, speculative_config: str, max_tokens: int) -> dict:
    """Tokens per verification step that ``speculative_config``'s n-gram proposer (read
    as the engine reads it) gets on each workload's greedy outputs, and its acceptance
    rate (every draft verified: no draft policy)."""
    from llmserve.config.speculative import SpeculativeConfig
    from llmserve.spec_decode.ngram_proposer import NgramProposer
    config = SpeculativeConfig.parse(speculative_config)
    if config.method != "ngram":
        raise SystemExit("--ceiling replays the n-gram proposer: give an ngram config")
    proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_max,
                             config.prompt_lookup_min)
    results = {}
    for name, prompts in WORKLOADS.items():
        _, outs = chat(llm, prompts, max_tokens)
        steps = drafted = accepted = produced = 0
        for o in outs:
            prompt, out = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
            i = 0
            while i < len(out):
                draft = proposer.propose(prompt + out[:i], limit=len(out) - i - 1)
                hits = 0
                while hits < len(draft) and draft[hits] == out[i + hits]:
                    hits += 1
                steps, drafted, accepted = steps + 1, drafted + len(draft), accepted + hits
                produced += hits + 1
                i += hits + 1
        rate = accepted / drafted if drafted else 0.0
        results[name] = {"tokens_per_step": produced / steps, "acceptance_rate": rate}
        print(f"{name:10s} tokens per verification step {produced / steps:.2f} (the speed-up "
              f"if verifying cost a decode step)   acceptance {rate:.2f}")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--speculative-config", default=json.dumps(SPEC))
    ap.add_argument("--draft-layers", type=int,
                    help="speculate with the model's first N layers as a draft model")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample (seeded, top_p 0.95) instead of greedy decoding")
    ap.add_argument("--every-draft", action="store_true",
                    help="verify every draft (no draft policy): acceptance rates to compare")
    ap.add_argument("--ceiling", action="store_true",
                    help="only the n-gram proposer's tokens per step on greedy outputs")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    if args.ceiling and (args.temperature or args.draft_layers):
        ap.error("--ceiling replays n-gram drafts over greedy outputs: not with "
                 "--temperature or --draft-layers")
    global TEMPERATURE
    TEMPERATURE = args.temperature
    if args.draft_layers:
        k = json.loads(args.speculative_config)["num_speculative_tokens"]
        draft = truncated_builtin(args.model, args.draft_layers,
                                  Path(tempfile.mkdtemp()) / "draft")
        args.speculative_config = json.dumps({"model": str(draft),
                                              "num_speculative_tokens": k})
    base = LLM(args.model)
    if args.ceiling:
        print(f"model {args.model} ({base.engine.config.dtype}), greedy, max_tokens "
              f"{args.max_tokens}, speculative_config {args.speculative_config}")
        results = ngram_ceiling(base, args.speculative_config, args.max_tokens)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return
    spec = LLM(args.model, speculative_config=args.speculative_config)
    specs = {"spec": spec}
    if args.temperature and args.draft_layers:
        specs["argmax drafts"] = LLM(args.model, speculative_config=args.speculative_config)
        specs["argmax drafts"].engine.spec.sampler = argmax_drafts
    for llm in specs.values() if args.every_draft else ():
        llm.engine.spec.policy = None
    how = f"temperature {args.temperature}, seeded" if args.temperature else "greedy"
    print(f"model {args.model} ({base.engine.config.dtype}), speculative_config "
          f"{args.speculative_config}, {how}, max_tokens {args.max_tokens}")
    warm = [p for ps in WORKLOADS.values() for p in ps]
    for llm in (base, *specs.values()):
        chat(llm, warm[:1], args.max_tokens)
        chat(llm, warm, args.max_tokens)
    results = {}
    for name, prompts in WORKLOADS.items():
        for label, llm in specs.items():
            r = results[name if label == "spec" else f"{name} ({label})"] = run(
                base, llm, prompts, args.rounds, args.max_tokens)
            print(f"1 stream  {name:10s} base {r['tok_s_base']:7.1f} tok/s   {label} "
                  f"{r['tok_s_spec']:7.1f} tok/s   x{r['speedup']:.2f}   acceptance "
                  f"{r['acceptance_rate']:.2f}")
    mixed = [p for ps in WORKLOADS.values() for p in ps]
    mixed = (mixed * (args.streams // len(mixed) + 1))[:args.streams]
    r = results[f"{args.streams}_streams"] = run(base, spec, mixed, args.rounds,
                                                 args.max_tokens, streams=args.streams)
    print(f"{args.streams} streams (all workloads) base {r['tok_s_base']:7.1f} tok/s   spec "
          f"{r['tok_s_spec']:7.1f} tok/s   x{r['speedup']:.2f}   acceptance "
          f"{r['acceptance_rate']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
