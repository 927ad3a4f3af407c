"""The scheduler's step cost at 256 running and 1,000 waiting requests, with no model.

A Scheduler over a real BlockManager runs a steady stream: every step it schedules,
then does what the engine does with the batch (advance each sequence's computed
tokens, cache its full blocks, fork parallel samples, append a token to every
sequence that finished a prefill or decode, finish those at ``max_tokens``) and adds
new requests so that 1,000 wait again (built ahead: making prompts is not timed).
Printed: the median step (``schedule()`` plus that bookkeeping) and the median
``schedule()`` alone, in microseconds, per policy:

- ``fcfs``: one tenant; priorities are drawn but the policy ignores them.
- ``priority``: one tenant, priorities 0-3 (urgent arrivals preempt running work).
- ``tenant-fair``: fcfs with four tenants of weights 1, 1, 2 and 4.

The workload (seeded): prompts of 16-1,024 tokens, 16-128 output tokens, one request
in 20 with two parallel samples; 16-token blocks, enough of them that memory never
binds, ``max_num_seqs=256`` and a 2,048-token budget with chunked prefill. It only
uses the scheduler's public surface, so the same file times another tree:

    python benchmarks/engine/scheduler_step.py
    python benchmarks/engine/scheduler_step.py --compare OTHER_TREE/.venv/bin/python

``--compare`` runs the other tree's interpreter (whichever ``llmserve`` it imports)
and this one alternately, ``--rounds`` times each, and prints both and their ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import time

POLICIES = {  # name: (scheduling_policy, tenants as (name, weight))
    "fcfs": ("fcfs", [("", 1.0)]),
    "priority": ("priority", [("", 1.0)]),
    "tenant-fair": ("fcfs", [("a", 1.0), ("b", 1.0), ("c", 2.0), ("d", 4.0)]),
}
RUNNING, WAITING = 256, 1000
BLOCK_SIZE, NUM_BLOCKS = 16, 32768
WARMUP_STEPS = 150
TOKENS = range(3, 30000)


class Stream:
    """One policy's scheduler and the seeded requests it is fed."""

    def __init__(self, policy: str, tenants: list[tuple[str, float]], seed: int):
        from llmserve.config import EngineConfig
        from llmserve.core.block_manager import BlockManager
        from llmserve.core.sched.scheduler import Scheduler

        config = EngineConfig(model="none", device="cpu", block_size=BLOCK_SIZE,
                              max_num_seqs=RUNNING, max_num_batched_tokens=2048,
                              scheduling_policy=policy)
        bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, config.enable_prefix_caching,
                          config.watermark)
        self.sched = Scheduler(config, bm)
        self.tenants = tenants
        self.rng = random.Random(seed)
        self.arrivals = 0
        self.ready: list = []  # requests built ahead, outside the timed step
        self.refill()
        self.top_up()

    def refill(self) -> None:
        while len(self.ready) < WAITING + RUNNING:
            self.ready.append(self.new_request())

    def new_request(self):
        from llmserve.core.request import Request
        from llmserve.core.sampling_params import SamplingParams

        rng = self.rng
        self.arrivals += 1
        prompt = rng.choices(TOKENS, k=rng.randint(16, 1024))
        params = SamplingParams(max_tokens=rng.randint(16, 128),
                                n=2 if rng.random() < 0.05 else 1)
        tenant, weight = rng.choice(self.tenants)
        return Request(f"r{self.arrivals}", None, prompt, params,
                       arrival_time=float(self.arrivals), priority=rng.randint(0, 3),
                       tenant=tenant, tenant_weight=weight)

    def top_up(self) -> None:
        while len(self.sched.waiting) < WAITING:
            self.sched.add(self.ready.pop().sequences[0])

    def bookkeeping(self, batch) -> None:
        """What the engine does with a step's batch, less the model."""
        from llmserve.core.request import SequenceStatus

        sched, due = self.sched, []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            sched.bm.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                due.append(seq)
                due += sched.fork_children(seq)
        for seq in due:
            seq.append_token(TOKENS[seq.num_tokens % len(TOKENS)])
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
        self.top_up()

    def step(self) -> tuple[int, int]:
        """(whole step, schedule() alone), in nanoseconds."""
        start = time.perf_counter_ns()
        batch = self.sched.schedule()
        scheduled = time.perf_counter_ns()
        self.bookkeeping(batch)
        end = time.perf_counter_ns()
        self.refill()
        return end - start, scheduled - start


def measure(name: str, steps: int, seed: int) -> dict:
    policy, tenants = POLICIES[name]
    stream = Stream(policy, tenants, seed)
    for _ in range(WARMUP_STEPS):
        stream.step()
    gc.collect()
    times = [stream.step() for _ in range(steps)]
    sched = stream.sched
    return {"step_us": statistics.median(t for t, _ in times) / 1000,
            "schedule_us": statistics.median(s for _, s in times) / 1000,
            "running": len(sched.running), "waiting": len(sched.waiting),
            "preemptions": sched.num_preemptions}


def run_here(names: list[str], steps: int, seed: int) -> dict:
    import llmserve
    return {"tree": llmserve.__file__,
            "results": {name: measure(name, steps, seed) for name in names}}


def compare(other_python: str, args) -> None:
    """Alternate the two interpreters, ``rounds`` runs each; medians over the runs."""
    cmd = ["--policies", ",".join(args.policies), "--steps", str(args.steps),
           "--seed", str(args.seed), "--json"]
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    trees = {}
    for rnd in range(args.rounds):
        for label, python in (("before", other_python), ("after", sys.executable)):
            out = subprocess.run([python, __file__, *cmd], capture_output=True, text=True,
                                 check=True).stdout
            result = json.loads(out)
            trees[label] = result["tree"]
            runs[label].append(result["results"])
            print(f"round {rnd + 1} {label}: " + ", ".join(
                f"{n} {r['step_us']:.0f} us" for n, r in result["results"].items()),
                flush=True)
    for label, tree in trees.items():
        print(f"{label}: {tree}")
    print(f"{'policy':<12} {'before us':>10} {'after us':>10} {'after/before':>13} "
          f"{'sched before':>13} {'sched after':>12}")
    for name in args.policies:
        before = statistics.median(r[name]["step_us"] for r in runs["before"])
        after = statistics.median(r[name]["step_us"] for r in runs["after"])
        sb = statistics.median(r[name]["schedule_us"] for r in runs["before"])
        sa = statistics.median(r[name]["schedule_us"] for r in runs["after"])
        print(f"{name:<12} {before:>10.0f} {after:>10.0f} {after / before:>13.2f} "
              f"{sb:>13.0f} {sa:>12.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    ap.add_argument("--steps", type=int, default=200, help="timed steps per policy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", metavar="PYTHON",
                    help="another tree's interpreter, run alternately with this one")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare, args)
        return
    result = run_here(args.policies, args.steps, args.seed)
    if args.json:
        print(json.dumps(result))
        return
    print(f"llmserve: {result['tree']}")
    for name, r in result["results"].items():
        print(f"{name:<12} step {r['step_us']:8.0f} us   schedule() {r['schedule_us']:8.0f} us"
              f"   running {r['running']}, waiting {r['waiting']}, "
              f"preemptions {r['preemptions']}")


if __name__ == "__main__":
    main()
