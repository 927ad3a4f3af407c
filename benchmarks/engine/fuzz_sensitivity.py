"""Mutation sensitivity of the differential fuzz tests: how many random workloads it
takes to catch realistic scheduler / block-manager bugs (the evidence for sizing
NUM_WORKLOADS in CI). Each mutant injects one bug by monkeypatching llmserve, then runs
the loop of tests/engine/test_differential_fuzz.py (or, ``--harness async``, the sync-vs-async
test of tests/engine/test_async_scheduling.py) exactly as CI does, in a process of its own, up
to the first failure. Reported: the 1-based workload that caught it (0: while building
the references) and "hits", how often the bug changed what the code did (0: never
reached, so the run says nothing). ``none`` is the control and must pass.

    python benchmarks/engine/fuzz_sensitivity.py                  # every mutant, seeds 11,12,13
    python benchmarks/engine/fuzz_sensitivity.py --mutants none,cow_skipped --seeds 11 \\
        --workloads 40
    python benchmarks/engine/fuzz_sensitivity.py --harness async  # seeds 5,6,7, 24 workloads
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import random
import sys
import tempfile
import time
import traceback
import weakref
from pathlib import Path

import torch
from _pytest.monkeypatch import MonkeyPatch

if not __package__:  # run as a file: the repository root, so that `benchmarks` imports
    sys.path.append(str(Path(__file__).resolve().parents[2]))

import llmserve.core.block_manager as bm_mod
import llmserve.model_executor.layers.sampler as sampler_mod
from llmserve.config import EngineConfig
from llmserve.core.block_manager import NO_HASH, BlockManager
from llmserve.core.request import Sequence, SequenceStatus
from llmserve.core.sched.async_scheduler import AsyncScheduler
from llmserve.core.sched.scheduler import Scheduler
from llmserve.engine.detokenizer import Detokenizer
from llmserve.engine.llm_engine import LLMEngine
from llmserve.model_executor.model_loader.sources import resolve_model
from tests import differential as diff
from tests.conftest import BUILTIN, write_tiny_checkpoint  # (sets the CPU dtype)

hits = None  # in a run's process: a shared count of the times the bug changed something


def hit() -> None:
    hits.value += 1


# --- mutants: each applies one bug through ``mp`` and calls hit() where it bites ---------
def none(mp):
    """Control: no bug; must pass every workload."""


def cow_skipped(mp):
    """Copy-on-write skipped: a forked sample writes into the block its siblings share."""
    orig = BlockManager.allocate

    def allocate(self, seq, num_tokens):
        if self._shared_write_block(seq) is None:
            return orig(self, seq, num_tokens)
        hit()
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take_free_block())
    mp.setattr(BlockManager, "allocate", allocate)


def hash_ignores_parent(mp):
    """Prefix-cache key of a block covers its own tokens only, not the blocks before it."""
    orig, seen = bm_mod.hash_block, {}

    def hash_block(parent, token_ids, extra=b""):
        key, true = orig(NO_HASH, token_ids, extra), orig(parent, token_ids, extra)
        if seen.setdefault(key, true) != true:
            hit()  # two different prefixes now share a key
        return key
    mp.setattr(bm_mod, "hash_block", hash_block)


def swap_in_drops_last(mp):
    """Swap-in takes new device blocks but forgets to copy back the last one."""
    orig = BlockManager.swap_in

    def swap_in(self, seq):
        n = len(self.ops)
        orig(self, seq)
        if len(self.ops) > n:
            hit()
            del self.ops[-1]
    mp.setattr(BlockManager, "swap_in", swap_in)


def recompute_keeps_computed(mp):
    """Recompute preemption frees the blocks but does not reset num_computed_tokens."""
    def reset_for_recompute(self):
        hit()
        self.recomputed_until = max(self.recomputed_until, self.num_computed_tokens)
        self.spec_token_ids = []
    mp.setattr(Sequence, "reset_for_recompute", reset_for_recompute)


def release_at_one(mp):
    """Release off by one: a shared block goes back on the free list at refcount 1."""
    orig = BlockManager._release

    def _release(self, block_id):
        orig(self, block_id)
        if self.blocks[block_id].ref_count == 1:
            hit()
            self.free_queue[block_id] = None
    mp.setattr(BlockManager, "_release", _release)


def cache_before_computed(mp):
    """A full block enters the prefix cache once its tokens are known, before all its KV
    is computed (a prefill chunk that ends mid-block)."""
    orig = BlockManager.cache_full_blocks

    def cache_full_blocks(self, seq):
        real, bs = seq.num_computed_tokens, self.block_size
        known = min(len(seq.block_table) * bs, seq.num_tokens)
        if self.enable_prefix_caching and known // bs > max(real // bs, seq.num_cached_blocks):
            hit()
        seq.num_computed_tokens = max(real, known)
        try:
            orig(self, seq)
        finally:
            seq.num_computed_tokens = real
    mp.setattr(BlockManager, "cache_full_blocks", cache_full_blocks)


def seed_restarts_on_preemption(mp):
    """A seeded sample's random stream restarts from its seed after a preemption."""
    base, preempt, key_of = weakref.WeakKeyDictionary(), Scheduler.preempt, sampler_mod.race_key_of

    def noting_preempt(self, seq, step):
        base[seq] = seq.num_output_tokens
        preempt(self, seq, step)

    def race_key_of(seq):
        seed = seq.params.sample_seed(seq.index)
        if seed is None or not base.get(seq):
            return key_of(seq)
        hit()
        return sampler_mod.race_key(seed, seq.num_output_tokens - base[seq])
    mp.setattr(Scheduler, "preempt", noting_preempt)
    mp.setattr(sampler_mod, "race_key_of", race_key_of)


def stop_string_window(mp):
    """Stop-string search window off by one: a match ending on the first new character is
    missed (the same alone as in a batch: the run-alone oracle cannot see it)."""
    def _check_stop_strings(seq, old_len):
        text, stops = seq.text, seq.params.stop
        right = max(0, old_len - max(len(s) for s in stops) + 1)
        for stop in stops:
            at = text.find(stop, right + 1)
            if at < 0 and text.find(stop, right) == right:
                hit()
            if at >= 0:
                seq.text = text[:at + len(stop) if seq.params.include_stop_str_in_output else at]
                seq.stop_reason = stop
                return stop
        return None
    mp.setattr(Detokenizer, "_check_stop_strings", staticmethod(_check_stop_strings))


def abort_leaks_swap(mp):
    """Aborting a swapped-out request forgets to give back its CPU swap blocks."""
    orig = Scheduler.finish

    def finish(self, seq, status):
        if seq.status is SequenceStatus.SWAPPED:
            hit()
            seq.cpu_block_table = []  # never returned to free_cpu_blocks
        orig(self, seq, status)
    mp.setattr(Scheduler, "finish", finish)


def can_swap_out_off_by_one(mp):
    """Swap-space check off by one: a sequence is swapped out with one CPU block too few."""
    def can_swap_out(self, seq):
        need = self.num_held(seq.block_table)
        if len(self.free_cpu_blocks) == need - 1:
            hit()
        return len(self.free_cpu_blocks) >= need - 1
    mp.setattr(BlockManager, "can_swap_out", can_swap_out)


def prefix_match_takes_all(mp):
    """A prefix-cache match may cover the whole sequence, leaving no token to compute
    (when its length is a multiple of the block size)."""
    orig = BlockManager.match_prefix

    def match_prefix(self, seq):
        found, n = orig(self, seq), seq.num_tokens // self.block_size
        if self.enable_prefix_caching and seq.params.prompt_logprobs is None and \
                len(found) == (seq.num_tokens - 1) // self.block_size < n:
            last = self.cached.get(self._hashes(seq, n)[n - 1])
            if last is not None:
                hit()
                return found + [last]
        return found
    mp.setattr(BlockManager, "match_prefix", match_prefix)


def abort_keeps_placeholder(mp):
    """Async scheduling: aborting a request with a token in flight keeps its placeholder
    as an output token (reachable in the async harness only)."""
    def drop_place(seq):  # called only for a sequence holding one
        hit()
    mp.setattr(AsyncScheduler, "drop_place", staticmethod(drop_place))


MUTANTS = {f.__name__: f for f in (
    none, cow_skipped, hash_ignores_parent, swap_in_drops_last, recompute_keeps_computed,
    release_at_one, cache_before_computed, seed_restarts_on_preemption, stop_string_window,
    abort_leaks_swap, can_swap_out_off_by_one, prefix_match_takes_all, abort_keeps_placeholder)}


# --- the CI tests' loops: each yields once the references are built, then after every
# workload i whether the test's closing assertion would hold with NUM_WORKLOADS = i ------
def _engine(model, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, kv_cache_memory=256 * diff.TINY_BLOCK_BYTES,
                                  preemption_mode="swap", swap_space=128 * diff.TINY_BLOCK_BYTES,
                                  **overrides))


def _workload(rng, pool):
    return diff.random_workload(rng, pool, diff.BLOCK, max_blocks=256, max_cpu_blocks=128)


def fuzz_harness(model, seed: str, workloads: int):
    """tests/engine/test_differential_fuzz.py::test_random_workloads_match_their_runs_alone"""
    differential = diff.Differential(_engine(model, check_kv_integrity=True), ample_blocks=256)
    rng = random.Random(seed)
    vocab = differential.engine.hf_config.vocab_size
    pool = diff.with_stop_strings(differential, diff.spec_pool(rng, vocab, size=48), rng)
    stats = {"preemptions": 0, "swaps": 0, "hits": 0}
    yield
    for i in range(1, workloads + 1):
        differential.run(_workload(rng, pool))
        sched, bm = differential.engine.scheduler, differential.engine.block_manager
        stats["preemptions"] += sched.num_preemptions
        stats["swaps"] += sched.num_swapped_out
        stats["hits"] += bm.prefix_hits
        yield stats["preemptions"] > i and stats["swaps"] > 0 and stats["hits"] > 0


def async_harness(model, seed: str, workloads: int):
    """tests/engine/test_async_scheduling.py::test_random_workloads_match_the_synchronous_engine
    (its closing assertion less the count of rows read on the device)"""
    sync = diff.Differential(_engine(model), ample_blocks=256)
    overlapped = diff.Differential(_engine(model, async_scheduling=True), ample_blocks=256)
    overlapped.reference = sync.reference
    rng = random.Random(seed)
    vocab = sync.engine.hf_config.vocab_size
    pool = diff.with_stop_strings(sync, diff.spec_pool(rng, vocab, size=40), rng)
    preemptions = swaps = 0
    yield
    for i in range(1, workloads + 1):
        overlapped.run(_workload(rng, pool))
        preemptions += overlapped.engine.scheduler.num_preemptions
        swaps += overlapped.engine.scheduler.num_swapped_out
        yield overlapped.num_compared > i and preemptions > 0 and swaps > 0


HARNESSES = {"fuzz": fuzz_harness, "async": async_harness}


def _child(harness, model, mutant, seed, workloads, threads, done, nhits, out) -> None:
    """One run (a process of its own: a bug may crash it natively). ``done``: workloads
    passed (-1: still building the references)."""
    global hits
    torch.set_num_threads(threads)
    mp, oks, why, hits = MonkeyPatch(), [], None, nhits
    try:
        MUTANTS[mutant](mp)
        gen = HARNESSES[harness](model, seed, workloads)
        next(gen)
        done.value = 0
        for ok in gen:
            oks.append(ok)
            done.value = len(oks)
    except Exception as e:  # AssertionError, KVIntegrityError, anything
        where = traceback.extract_tb(e.__traceback__)[-1]
        first = (str(e).strip().splitlines() or [""])[0][:100]
        why = f"{type(e).__name__} ({Path(where.filename).name}:{where.lineno}) {first}"
    finally:
        mp.undo()
    # With the smallest NUM_WORKLOADS from which the closing assertion holds.
    out.put((why, next((i + 1 for i in range(len(oks)) if all(oks[i:])), None)))


def run_one(harness, model, mutant: str, seed: str, workloads: int, threads: int) -> dict:
    ctx, t0 = multiprocessing.get_context("spawn"), time.perf_counter()
    done, nhits, out = ctx.Value("i", -1, lock=False), ctx.Value("i", 0, lock=False), ctx.Queue()
    proc = ctx.Process(target=_child, args=(harness, str(model), mutant, seed, workloads,
                                            threads, done, nhits, out))
    proc.start()
    proc.join()
    try:
        why, stats_from = out.get(timeout=5)
    except queue.Empty:
        why, stats_from = f"the process died (exit code {proc.exitcode})", None
    return dict(mutant=mutant, seed=seed, caught=why is not None, why=why or "",
                at=done.value + 1 if why else None, hits=nhits.value, stats_from=stats_from,
                secs=time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--harness", choices=list(HARNESSES), default="fuzz")
    ap.add_argument("--seeds", help="comma-separated (default 11,12,13; async: 5,6,7)")
    ap.add_argument("--workloads", type=int, help="at most this many (default 120; async: 24)")
    ap.add_argument("--mutants", default=",".join(MUTANTS))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: as a `make test` xdist worker, pinned to a core)")
    args = ap.parse_args()
    fuzz = args.harness == "fuzz"
    seeds = (args.seeds or ("11,12,13" if fuzz else "5,6,7")).split(",")
    n, mutants = args.workloads or (120 if fuzz else 24), args.mutants.split(",")
    if unknown := set(mutants) - set(MUTANTS):
        sys.exit(f"unknown mutants {sorted(unknown)}; known: {', '.join(MUTANTS)}")
    tmp = tempfile.TemporaryDirectory()
    model = write_tiny_checkpoint(Path(tmp.name) / "llama", resolve_model(BUILTIN), "llama")
    results, t_all = [], time.perf_counter()
    for mutant in mutants:
        for seed in seeds:
            r = run_one(args.harness, model, mutant, seed, n, args.threads)
            results.append(r)
            verdict = f"caught at {r['at']}" if r["caught"] else (
                f"not caught in {n} (closing assertion holds from {r['stats_from']})")
            print(f"{mutant} seed {seed}: {verdict}; hits {r['hits']}; {r['secs']:.0f}s"
                  f"{'; ' + r['why'] if r['why'] else ''}", flush=True)
    print(f"\n{args.harness} harness, at most {n} workloads, {time.perf_counter() - t_all:.0f}s\n"
          "\n| mutant | what it models | hits | " + " | ".join(f"seed {s}" for s in seeds)
          + " |\n|---|---|---|" + "---|" * len(seeds))
    for mutant in mutants:
        rows = [r for r in results if r["mutant"] == mutant]
        print(f"| {mutant} | {' '.join(MUTANTS[mutant].__doc__.split())} | "
              f"{'/'.join(str(r['hits']) for r in rows)} | " + " | ".join(
                  str(r["at"]) if r["caught"] else f"not caught in {n}" for r in rows) + " |")
    if any(r["caught"] for r in results if r["mutant"] == "none"):
        print("\nWARNING: the control failed: the harness itself is unsound")
    caught = [r for r in results if r["caught"] and r["mutant"] != "none"]
    for seed in seeds:
        at = [r["at"] for r in caught if r["seed"] == seed]
        print(f"seed {seed}: max catching index {max(at, default='-')} over {len(at)} caught")
    for r in results:
        if r["hits"] == 0 and r["mutant"] != "none":
            print(f"note: {r['mutant']} (seed {r['seed']}) never reached its bug: it says nothing")


if __name__ == "__main__":
    main()
