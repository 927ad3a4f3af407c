"""Timing an engine's decode steps: a batch of sequences prefilled, then steps timed
with every sequence decoding one token a step; the requests are aborted after.

Two readings, as the scripts that report them always have: the mean over the steps
(the CPU comparisons, which report ratios of means) and the median in milliseconds
(the GPU checks, where the odd slow step, a graph capture or an allocator call, is not
the step's cost).

llmserve is imported inside the functions: a GPU check's smoke sets TRITON_INTERPRET
before anything imports the kernels."""

from __future__ import annotations

import random
import statistics
import time


def step_time(engine, batch: int, context: int, steps: int) -> float:
    """Mean seconds of ``steps`` decode steps of ``batch`` sequences of ``context``
    random prompt tokens (two unmeasured steps first)."""
    from llmserve import SamplingParams
    rng = random.Random(batch)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, 40000) for _ in range(context)],
                           SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_output_tokens == 0
                                          for s in engine.scheduler.running):
        engine.step()  # prefill
    for _ in range(2):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - t0) / steps
    for req_id in list(engine.requests):
        engine.abort(req_id)
    return elapsed


def decode_step_ms(engine, batch: int, steps: int, prompt_len: int = 128) -> float:
    """Median time of an engine step with ``batch`` sequences decoding (every step
    ends with the sampled tokens on the host, so it includes the GPU's work)."""
    from llmserve import SamplingParams
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    reqs = [engine.add_request([rng.randrange(3, 32000) for _ in range(prompt_len)], params)
            for _ in range(batch)]
    while any(not r.sequences[0].output_token_ids for r in reqs):  # prefills
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for r in reqs:  # the rest of each request measures nothing (the smoke's interpreter:
        engine.abort(r.request_id)  # ~1 s a step)
    while engine.has_unfinished():  # a step still in flight (async scheduling)
        engine.step()
    return 1000 * statistics.median(times)
