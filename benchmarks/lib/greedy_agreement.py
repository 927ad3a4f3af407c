"""Greedy tokens of an engine, and whether two configurations' differences are ties.

On a random-weight model the logits are nearly flat, so a different order of float32
sums (CUDA graphs fix a bucket's split-KV count where the eager path picks it per step)
can flip an argmax without anything being wrong. ``compare`` tells such a tie, broken
the other way within the two paths' rounding noise, from a real difference (a bug).

llmserve is imported inside the functions: a GPU check's smoke sets TRITON_INTERPRET
before anything imports the kernels."""

from __future__ import annotations


def run_to_end(engine, reqs) -> list:
    """Step ``engine`` until it is idle; each request's final output."""
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[r.request_id] for r in reqs]


def with_margins(output) -> list[tuple[int, float, float]]:
    """(token, its logprob, top-1 minus top-2 logprob) of a greedy output's first choice."""
    c = output.outputs[0]
    return [(t, lp.logprob, lp.top[0][1] - lp.top[1][1]) for t, lp in zip(c.token_ids, c.logprobs)]


def greedy(engine, prompts, max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens (``ignore_eos``), all prompts in one batch."""
    from llmserve import SamplingParams
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                 ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [r.sequences[0].output_token_ids for r in reqs]


def greedy_with_margins(engine, prompts, max_tokens: int) -> list[list[tuple[int, float, float]]]:
    """Greedy tokens of each prompt with (token, its logprob, top-1 minus top-2 logprob)."""
    from llmserve import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    reqs = [engine.add_request(p, params) for p in prompts]
    return [with_margins(out) for out in run_to_end(engine, reqs)]


def compare(base: list, other: list) -> dict:
    """Per differing sequence: where, the base's top-2 margin there, and the largest
    |logprob difference| of the same tokens before it (the two paths' rounding noise)."""
    diffs, noise = [], 0.0
    for a, b in zip(base, other):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x[0] != y[0]), None)
        stop = len(a) if first is None else first
        noise = max([noise] + [abs(x[1] - y[1]) for x, y in zip(a[:stop], b[:stop])])
        if first is not None:
            diffs.append({"at": first, "base_margin": a[first][2],
                          "other_margin": b[first][2]})
    worst = max((d["base_margin"] for d in diffs), default=0.0)
    return {"sequences": len(base), "differing": len(diffs), "differences": diffs,
            "noise_before": noise, "largest_margin_crossed": worst,
            "all_within_noise": worst <= 2 * noise}
