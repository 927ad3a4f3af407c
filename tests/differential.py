"""Differential testing of the engine under memory pressure.

A pool of request specs (prompts with shared prefixes, greedy or seeded sampling,
n > 1, stop strings) is run once each *alone* with ample memory: that is the
reference. A workload then submits some of them at chosen steps, with priorities and
aborts, into one engine configured tightly (scheduling policy, preemption mode,
prefix caching, chunk budget, KV blocks from barely-fits to ample). Every finished
request must equal its reference, every aborted one must be a prefix of it, and every
block must be free at the end. The engine runs with its KV integrity checks on (where
the configuration allows them: async scheduling refuses them).

One model load serves every run: ``reconfigure`` gives the engine a fresh block
manager and scheduler over a prefix of its KV blocks.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from llmserve import SamplingParams
from llmserve.core.block_manager import BlockManager
from llmserve.core.request import SequenceStatus
from llmserve.core.sched.async_scheduler import AsyncScheduler
from llmserve.core.sched.scheduler import Scheduler
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.output import CompletionOutput
from llmserve.utils import cdiv

TIE_GAP = 1e-4  # a greedy choice this close to the runner-up may flip with batch shape
# The tiny checkpoint's KV block (tests/conftest.py), shared by the fuzz tests.
BLOCK = 16
TINY_BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # K+V x layers x slots x kv heads x dim x fp32


@dataclass(frozen=True)
class Spec:
    prompt: tuple[int, ...]
    max_tokens: int
    n: int = 1
    seed: int | None = None  # None: greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()

    def params(self) -> SamplingParams:
        sampling = (dict(temperature=0.0) if self.seed is None
                    else dict(temperature=0.9, top_p=self.top_p, seed=self.seed))
        return SamplingParams(max_tokens=self.max_tokens, n=self.n, stop=list(self.stop),
                              logprobs=2, **sampling)


@dataclass
class Workload:
    arrivals: list[tuple[int, Spec, int]]  # (step, spec, priority)
    aborts: list[tuple[int, int]] = field(default_factory=list)  # (step, arrival index)
    num_blocks: int = 64
    num_cpu_blocks: int = 0
    config: dict = field(default_factory=dict)
    # From each of these steps on, abort the first request found swapped out (its CPU
    # blocks must come back): random aborts rarely catch a request while it is swapped.
    swapped_aborts: list[int] = field(default_factory=list)


def _swapped_out(reqs: list) -> object | None:
    """The first of ``reqs`` with a sequence swapped out to CPU memory, or None."""
    return next((r for r in reqs if r is not None and any(
        s.status is SequenceStatus.SWAPPED for s in r.sequences)), None)


def reconfigure(engine: LLMEngine, num_blocks: int, num_cpu_blocks: int = 0, **overrides):
    """Fresh scheduler state over the first ``num_blocks`` KV blocks."""
    assert not engine.has_unfinished()
    assert num_blocks <= engine.runner.num_blocks
    assert num_cpu_blocks <= engine.runner.num_cpu_blocks
    cfg = dataclasses.replace(engine.config, **overrides)
    if not cfg.enable_chunked_prefill:
        cfg.max_num_batched_tokens = max(cfg.max_num_batched_tokens, engine.max_model_len)
    core = engine.core
    bm = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching, cfg.watermark,
                      num_cpu_blocks, sliding_window=core.block_manager.sliding_window)
    engine.config = core.config = engine.inputs.config = cfg
    core.block_manager = engine.inputs.block_manager = bm
    core.scheduler = core.beam_stepper.scheduler = (
        AsyncScheduler if cfg.async_scheduling else Scheduler)(cfg, bm)
    if core.features.kv_transfer is not None:
        core.features.kv_transfer.block_manager = bm


class OutputLog:
    """What each request of an engine ended as: its last output (the outputs are
    cumulative) and whether it was aborted."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.last: dict[str, object] = {}
        self.aborted: set[str] = set()

    def step(self) -> None:
        for out in self.engine.step():
            self.last[out.request_id] = out

    def abort(self, request_id: str) -> None:
        if self.engine.abort(request_id):
            self.aborted.add(request_id)

    def samples(self, req) -> list[CompletionOutput]:
        """Each sample of ``req`` as it ended (an aborted one as "abort")."""
        out = self.last.get(req.request_id)
        samples = []
        for i in range(req.params.n):
            c = out.outputs[i] if out is not None else CompletionOutput(i, "", [], None)
            if c.finish_reason is None and req.request_id in self.aborted:
                c = dataclasses.replace(c, finish_reason="abort")
            samples.append(c)
        return samples


def drain(engine: LLMEngine, max_steps: int = 20000, log: OutputLog | None = None):
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return
        log.step() if log is not None else engine.step()
    raise AssertionError("the engine never drained: livelock or starvation")


class Differential:
    def __init__(self, engine: LLMEngine, ample_blocks: int):
        self.engine = engine
        self.ample_blocks = ample_blocks
        self.references: dict[Spec, list[CompletionOutput]] = {}
        self.num_compared = 0  # sequences checked against their reference
        self.num_swapped_aborts = 0  # requests aborted while swapped out

    def reference(self, spec: Spec) -> list[CompletionOutput]:
        if spec not in self.references:
            reconfigure(self.engine, self.ample_blocks, enable_prefix_caching=False,
                        scheduling_policy="fcfs", preemption_mode="recompute")
            req = self.engine.add_request(list(spec.prompt), spec.params())
            log = OutputLog(self.engine)
            drain(self.engine, log=log)
            self.references[spec] = log.samples(req)
        return self.references[spec]

    def run(self, w: Workload) -> None:
        refs = [self.reference(spec) for _, spec, _ in w.arrivals]
        reconfigure(self.engine, w.num_blocks, w.num_cpu_blocks, **w.config)
        reqs = [None] * len(w.arrivals)
        log = OutputLog(self.engine)
        last = max([s for s, _, _ in w.arrivals] + [s for s, _ in w.aborts])
        swapped_aborts = sorted(w.swapped_aborts)
        for step in range(20000):
            for i, (at, spec, priority) in enumerate(w.arrivals):
                if at == step:
                    reqs[i] = self.engine.add_request(list(spec.prompt), spec.params(),
                                                      priority=priority)
            for at, i in w.aborts:
                if at == step and reqs[i] is not None:
                    log.abort(reqs[i].request_id)
            while swapped_aborts and swapped_aborts[0] <= step and (
                    victim := _swapped_out(reqs)) is not None:
                log.abort(victim.request_id)
                swapped_aborts.pop(0)
                self.num_swapped_aborts += 1
            if step > last and not self.engine.has_unfinished():
                break
            log.step()
        else:
            raise AssertionError("the engine never drained: livelock or starvation")
        for req, ref in zip(reqs, refs):
            for got, want in zip(log.samples(req), ref):
                self.compare(got, want, w)
        self.engine.block_manager.check_all_free()

    def compare(self, got: CompletionOutput, want: CompletionOutput, w: Workload) -> None:
        self.num_compared += 1
        n = len(got.token_ids)
        if got.finish_reason == "abort":
            assert got.token_ids == want.token_ids[:n], self._explain(got, want, w)
            return
        for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
            if a != b:
                assert self._near_tie(want, i), self._explain(got, want, w, i)
                return  # diverged at a near-tie: the rest is a different story
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), (
            self._explain(got, want, w))

    @staticmethod
    def _near_tie(want: CompletionOutput, i: int) -> bool:
        top = want.logprobs[i].top
        return len(top) > 1 and top[0][1] - top[1][1] < TIE_GAP

    @staticmethod
    def _explain(got, want, w: Workload, i: int | None = None) -> str:
        where = "" if i is None else f" at output token {i}"
        return (f"sample {got.index} differs from its run alone{where}:\n"
                f"  got  {got.token_ids} ({got.finish_reason})\n"
                f"  want {want.token_ids} ({want.finish_reason})\n"
                f"  workload: {w}")


def spec_pool(rng: random.Random, vocab: int, size: int, prefixes: int = 3,
              prefix_len: int = 40) -> list[Spec]:
    """Requests that share prefixes (prefix caching), sample greedily or seeded, ask
    for n > 1 and sometimes carry a stop string. Some prompts are whole blocks of a
    shared prefix, alone (a cache match then covers the whole prompt, and must still
    leave its last token to compute) or followed by one common block (the same tokens
    after different prefixes: its hash must chain over its parents)."""
    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    shared = [tokens(prefix_len) for _ in range(prefixes)]
    common_block = tokens(BLOCK)
    aligned = prefix_len // BLOCK * BLOCK
    pool = []
    for _ in range(size):
        kind = rng.random()
        if kind < 0.45:
            prompt = rng.choice(shared) + tokens(rng.randint(1, 30))
        elif kind < 0.6 and aligned:
            prompt = rng.choice(shared)[:aligned]
            if rng.random() < 0.5:
                prompt = prompt + common_block + tokens(rng.randint(0, 10))
        else:
            prompt = tokens(rng.randint(1, 70))
        seed = rng.randrange(1 << 30) if rng.random() < 0.4 else None
        top_p = rng.choice([1.0, 1.0, 0.9])
        n = rng.choice([1, 1, 1, 2, 3])
        pool.append(Spec(tuple(prompt), rng.randint(1, 24), n, seed, top_p))
    return pool


def with_stop_strings(diff: Differential, pool: list[Spec], rng: random.Random) -> list[Spec]:
    """Give some specs a stop string taken from their own reference text, so it fires."""
    out = []
    for spec in pool:
        text = diff.reference(spec)[0].text
        if len(text) > 6 and rng.random() < 0.3:
            at = rng.randrange(1, len(text) - 3)
            spec = dataclasses.replace(spec, stop=(text[at:at + 2],))
        out.append(spec)
    return out


def random_workload(rng: random.Random, pool: list[Spec], block_size: int,
                    max_blocks: int, max_cpu_blocks: int) -> Workload:
    chosen = [rng.choice(pool) for _ in range(rng.randint(2, 12))]
    arrivals = [(rng.randint(0, 12), spec, rng.randint(0, 3)) for spec in chosen]
    # Barely fits: the largest single sequence; ample: everything at once.
    def blocks(s: Spec) -> int:  # one sample's blocks at its longest
        return cdiv(len(s.prompt) + s.max_tokens, block_size)

    need = max(blocks(s) for s in chosen)
    total = sum(s.n * blocks(s) for s in chosen)
    # Mostly tight: a quarter of the way from barely-fits to ample, at most.
    top = need + (total - need) // (4 if rng.random() < 0.75 else 1)
    num_blocks = min(max_blocks, rng.randint(need, max(need, top)))
    aborts = [(rng.randint(0, 30), rng.randrange(len(arrivals)))
              for _ in range(rng.choice([0, 0, 1, 2]))]
    swapped_aborts = [rng.randint(0, 30) for _ in range(rng.choice([0, 0, 1]))]
    chunked = rng.random() < 0.8
    config = dict(
        scheduling_policy=rng.choice(["fcfs", "priority"]),
        preemption_mode=rng.choice(["recompute", "swap"]),
        enable_prefix_caching=rng.random() < 0.6,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=rng.choice([8, 16, 32, 64, 128, 512]),
        max_num_seqs=rng.choice([1, 2, 4, 8, 16, 64]),
        watermark=rng.choice([0.0, 0.01, 0.1]),
    )
    # Swap space: none, some, all, or about one request's blocks (where a swap-out
    # that needs exactly what is free, or one more, decides what happens).
    group = max(s.n * blocks(s) for s in chosen)
    num_cpu = rng.choice([0, rng.randint(0, max_cpu_blocks), max_cpu_blocks,
                          rng.randint(1, min(group, max_cpu_blocks))])
    return Workload(arrivals, aborts, num_blocks, num_cpu, config, swapped_aborts)
