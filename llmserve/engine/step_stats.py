"""What a step reports to whoever watches it: ``SchedulerStats`` (the engine's state
after the step, and its counters), pushed to the metrics (metrics.py); ``EngineStats``
(where a run's time went), read by benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_swapped_seqs: int = 0
    kv_cache_usage: float = 0.0
    # Prompt tokens not computed yet, of waiting and prefilling requests.
    num_waiting_prompt_tokens: int = 0
    # Running totals since the engine started (the metrics count the increments).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_swapped_out: int = 0
    tenant_tokens: dict[str, int] = field(default_factory=dict)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Multi-LoRA (None when off): the adapters running and waiting, by name.
    running_loras: list[str] | None = None
    waiting_loras: list[str] | None = None
    # The step just run: (measured, predicted) seconds, or None if none ran.
    step_seconds: tuple[float, float | None] | None = None


def scheduler_stats(core) -> SchedulerStats:
    """The core's state now, read off what the scheduler's collections keep as sequences
    come and go (``SequenceTally``): no queue is scanned, only the running batch for its
    prompts still prefilling. A waiting sequence has computed nothing (a preempted one is
    queued again from its start), so its prompt is all still to compute."""
    sched, bm = core.scheduler, core.block_manager
    running, waiting = sched.running.tally, sched.waiting.tally
    prefilling = sum(max(0, s.num_prompt_tokens - s.num_computed_tokens) for s in sched.running)
    stats = SchedulerStats(
        num_running_reqs=running.num_requests, num_waiting_reqs=waiting.num_requests,
        num_swapped_seqs=len(sched.swapped), kv_cache_usage=bm.usage,
        num_waiting_prompt_tokens=waiting.prompt_tokens + prefilling,
        prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
        num_preemptions=sched.num_preemptions, num_swapped_out=sched.num_swapped_out,
        tenant_tokens=sched.shares.tokens_served, step_seconds=core.last_step)
    spec = core.features.speculation
    if spec is not None:
        s = spec.speculator
        stats.spec_drafts, stats.spec_draft_tokens = s.num_drafts, s.num_draft_tokens
        stats.spec_accepted_tokens = s.num_accepted_tokens
    if core.features.loras is not None:
        stats.running_loras, stats.waiting_loras = (running.adapter_names(),
                                                    waiting.adapter_names())
    return stats


class EngineStats:
    """Step counters for benchmarks: where the time goes."""

    def __init__(self):
        self.steps = 0
        self.tokens = 0
        self.schedule_s = 0.0
        self.forward_s = 0.0  # batch preparation + forward + logits
        self.post_s = 0.0  # sampling + detokenisation + bookkeeping

    def record_step(self, batch, schedule_s: float, forward_s: float, post_s: float) -> None:
        self.steps += 1
        self.tokens += batch.num_tokens
        self.schedule_s += schedule_s
        self.forward_s += forward_s
        self.post_s += post_s
