"""What rounding x to int8 costs in quality: the built-in model's answers and
log-likelihoods with int4 weights and x in float32 or rounded to int8 (``panel_int8.h``,
``LLMSERVE_CPU_INT8_ACTIVATIONS``), each against the unquantised float32 model.

Three engines, one after the other, in this process:
  * float32, unquantised: the reference;
  * int4 (``--quantization auto``), x in float32 (``LLMSERVE_CPU_INT8_ACTIVATIONS=0``);
  * int4, x rounded to int8 per group of 32 (the default where the CPU has AVX-512 VNNI
    and no AMX tiles in use, ``gemm.rounds_x_to_int8``; and on AVX2 builds, where the
    int8 LM head keeps x in float32, so this engine is the table's "int4 products only"
    row). On CPUs with bf16 arithmetic "x in float32" is x in bf16 (the serving dtype);
    with AMX tiles in use both int4 engines keep x in bf16.
Each scores the 40 questions of the task the repository ships (benchmarks/data/lm_eval:
the log-likelihood of every choice after "Answer:", prompt logprobs) and continues 16 of
them greedily for 48 tokens, all at once (decode steps of 16 rows: the C decoder stack,
which rounds x where enabled). Prints each int4 engine's accuracy, its mean |log-prob
difference| per prompt token from the reference, and the share of greedy tokens equal
to the reference's before the first that differs. The int8 rounding's own cost is the
difference between the two int4 rows: the int4 weights' cost is the first.

    python benchmarks/cpu/int8_activations.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.paths import DATA
from llmserve import SamplingParams
from llmserve.entrypoints.llm import LLM
from llmserve.kernels.cpu.native import panel_int8_built

TASK = DATA / "lm_eval" / "facts.jsonl"
MODES = {  # name: (engine arguments, LLMSERVE_CPU_INT8_ACTIVATIONS)
    "float32, unquantised": (dict(dtype="float32", quantization="none"), "0"),
    "int4, x in float32": (dict(dtype="auto", quantization="auto"), "0"),
    "int4, x rounded to int8": (dict(dtype="auto", quantization="auto"), "1"),
}


def questions() -> list[dict]:
    return [json.loads(line) for line in TASK.read_text().splitlines() if line.strip()]


def score(llm: LLM, items: list[dict]) -> tuple[list[int], list[float]]:
    """The chosen answer of each question (highest log-likelihood of its choice's
    tokens), and the log-probs of every prompt token of every choice, in order."""
    tok = llm.tokenizer
    prompts, spans = [], []
    for item in items:
        prefix = tok.encode(f"Question: {item['question']}\nAnswer:")
        for choice in item["choices"]:
            ids = tok.encode(f"Question: {item['question']}\nAnswer: {choice}")
            prompts.append(ids)
            spans.append(len(ids) - len(prefix))
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    logprobs = [[lp.logprob for lp in out.prompt_logprobs[1:]] for out in outs]
    choice_scores = [sum(lps[-span:]) for lps, span in zip(logprobs, spans)]
    chosen, at = [], 0
    for item in items:
        n = len(item["choices"])
        best = max(range(n), key=lambda i: choice_scores[at + i])
        chosen.append(best)
        at += n
    return chosen, [lp for lps in logprobs for lp in lps]


def greedy(llm: LLM, items: list[dict]) -> list[list[int]]:
    prompts = [f"Question: {item['question']}\nAnswer:" for item in items[:16]]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def agreement(ids: list[list[int]], ref: list[list[int]]) -> float:
    """Share of tokens equal to the reference's before the first that differs."""
    same = 0
    for a, b in zip(ids, ref):
        for x, y in zip(a, b):
            if x != y:
                break
            same += 1
    return same / sum(len(b) for b in ref)


def main() -> None:
    if not panel_int8_built():
        print("note: this CPU's kernels have no int8 panels: the last row equals the second")
    items = questions()
    results = {}
    for name, (args, int8) in MODES.items():
        os.environ["LLMSERVE_CPU_INT8_ACTIVATIONS"] = int8
        llm = LLM(kv_cache_memory=256 << 20, **args)
        chosen, logprobs = score(llm, items)
        results[name] = (chosen, logprobs, greedy(llm, items))
        llm.shutdown()
    ref_chosen, ref_lps, ref_ids = results["float32, unquantised"]
    correct = sum(c == item["answer"] for c, item in zip(ref_chosen, items))
    print(f"{'engine':28} {'accuracy':>9} {'same answer':>12} {'mean |dlogp|':>13} "
          f"{'greedy agreement':>17}")
    print(f"{'float32, unquantised':28} {correct:>6}/{len(items)} {'-':>12} {'-':>13} {'-':>17}")
    for name in list(MODES)[1:]:
        chosen, lps, ids = results[name]
        correct = sum(c == item["answer"] for c, item in zip(chosen, items))
        same = sum(c == r for c, r in zip(chosen, ref_chosen))
        dlogp = sum(abs(a - b) for a, b in zip(lps, ref_lps)) / len(ref_lps)
        print(f"{name:28} {correct:>6}/{len(items)} {same:>9}/{len(items)} {dlogp:>13.4f} "
              f"{agreement(ids, ref_ids):>17.1%}")
    print(f"({len(ref_lps)} prompt tokens; greedy: 16 prompts x 48 tokens)")


if __name__ == "__main__":
    main()
