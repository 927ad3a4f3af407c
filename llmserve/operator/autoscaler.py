"""The autoscaling decision: a pure function of observations, spec and history.

HPA-shaped: each metric proposes ``ceil(current x observed / target)`` unless the
ratio is within the tolerance band; the larger proposal wins. Proposals are kept
for the stabilisation windows: scaling up takes the smallest proposal of the
up-window, scaling down the largest of the down-window (so a short dip never
drops replicas). Bounds clamp the result; an idle deployment may go to zero after
``scaleToZeroAfterSeconds``; missing metrics hold the current size.

Each engine pool decides alone, on its own metrics: the main (decode, or colocated)
pool on queue depth and KV utilisation; a prefill pool (``spec.prefill``) on the
prompt tokens waiting to be computed and on queue depth, within its own bounds
(``Policy.for_prefill``). A metric whose target is None proposes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_TARGET_WAITING_PROMPT_TOKENS = 4096  # per prefill replica


@dataclass
class Observation:
    """Engine metrics summed (queue, running) or averaged (KV) over ready replicas."""
    waiting: float
    running: float
    kv_usage: float
    ready_replicas: int
    demand_at_zero: float = 0.0  # requests a gateway holds while no engine exists
    waiting_prompt_tokens: float = 0.0  # llmserve:num_waiting_prompt_tokens, summed


@dataclass
class Policy:
    min_replicas: int = 1
    max_replicas: int = 4
    target_queue_depth: float = 4.0
    target_kv_utilization: float | None = 0.8
    target_waiting_prompt_tokens: float | None = None  # per replica
    tolerance: float = 0.1
    scale_up_window: float = 0.0
    scale_down_window: float = 300.0
    scale_to_zero_after: float = 0.0  # 0 = never

    @classmethod
    def from_spec(cls, spec: dict) -> Policy:
        a = spec.get("autoscaling") or {}
        return cls(min_replicas=a.get("minReplicas", 1), max_replicas=a.get("maxReplicas", 4),
                   target_queue_depth=a.get("targetQueueDepth", 4.0),
                   target_kv_utilization=a.get("targetKVUtilization", 0.8),
                   tolerance=a.get("tolerance", 0.1),
                   scale_up_window=a.get("scaleUpStabilizationSeconds", 0),
                   scale_down_window=a.get("scaleDownStabilizationSeconds", 300),
                   scale_to_zero_after=a.get("scaleToZeroAfterSeconds", 0))

    @classmethod
    def for_prefill(cls, spec: dict) -> Policy:
        """The prefill pool: its own bounds and prompt-token target; the queue target,
        tolerance and windows of ``spec.autoscaling``. KV utilisation is no signal
        there (a prefill engine holds blocks only until they are read), and the pool
        never scales to zero (while it is empty, decode engines prefill alone)."""
        pool, p = spec.get("prefill") or {}, cls.from_spec(spec)
        return cls(min_replicas=max(1, pool.get("minReplicas", 1)),
                   max_replicas=pool.get("maxReplicas", 4),
                   target_queue_depth=p.target_queue_depth, target_kv_utilization=None,
                   target_waiting_prompt_tokens=pool.get("targetWaitingPromptTokens",
                                                         DEFAULT_TARGET_WAITING_PROMPT_TOKENS),
                   tolerance=p.tolerance, scale_up_window=p.scale_up_window,
                   scale_down_window=p.scale_down_window, scale_to_zero_after=0)


@dataclass
class History:
    """What the decision remembers between calls (kept in the operator's memory;
    after a restart it starts empty, which only makes the next decisions cautious)."""
    proposals: list[tuple[float, int]] = field(default_factory=list)  # (time, replicas)
    last_active: float | None = None  # last time any request was queued or running


@dataclass
class Decision:
    replicas: int
    reason: str


def propose(current: int, obs: Observation, p: Policy) -> tuple[int, str]:
    """What the metrics ask for, before windows and bounds."""
    per_replica = max(obs.ready_replicas, 1)
    signals = [(obs.waiting / per_replica, p.target_queue_depth,
                "queue depth", f"{obs.waiting:g}"),
               (obs.kv_usage, p.target_kv_utilization,
                "KV utilisation", f"{obs.kv_usage:.2f}"),
               (obs.waiting_prompt_tokens / per_replica, p.target_waiting_prompt_tokens,
                "waiting prompt tokens", f"{obs.waiting_prompt_tokens:g}")]
    asks = [_ask(current, value / target, p.tolerance, name, shown)
            for value, target, name, shown in signals if target is not None]
    return max(asks, key=lambda a: a[0])


def _ask(current: int, ratio: float, tolerance: float, name: str, shown: str
         ) -> tuple[int, str]:
    """One metric's proposal: ``ceil(current x observed / target)`` outside the
    tolerance band, else the current size."""
    if abs(ratio - 1) > tolerance:
        return math.ceil(max(current, 1) * ratio), f"{name} {shown}"
    return current, f"{name} within tolerance"


def decide(current: int, obs: Observation | None, p: Policy, history: History,
           now: float) -> Decision:
    if current == 0:
        if obs is not None and obs.demand_at_zero > 0:
            return Decision(max(1, p.min_replicas), "requests waiting at zero replicas")
        floor = p.min_replicas if p.scale_to_zero_after <= 0 else 0
        if floor > 0:
            return Decision(floor, "below minReplicas")
        return Decision(0, "idle at zero")
    if obs is None:
        return Decision(current, "metrics unavailable: holding")
    busy = obs.waiting + obs.running > 0
    if busy or history.last_active is None:
        history.last_active = now
    if not history.proposals:  # a fresh operator: the current size counts as a proposal
        history.proposals.append((now, current))
    want, reason = propose(current, obs, p)
    history.proposals.append((now, want))
    horizon = max(p.scale_up_window, p.scale_down_window)
    history.proposals = [(t, r) for t, r in history.proposals if now - t <= horizon]
    if want > current:
        want = max(min(_window(history, now, p.scale_up_window, want)), current)
    elif want < current:
        want = min(max(_window(history, now, p.scale_down_window, want)), current)
        if want == current:
            reason = "scale-down held by the stabilisation window"
    lower = max(p.min_replicas, 1)
    if (p.scale_to_zero_after > 0 and not busy
            and now - history.last_active >= p.scale_to_zero_after):
        return Decision(0, f"idle for {now - history.last_active:.0f} s: scaling to zero")
    bounded = min(max(want, lower), p.max_replicas)
    if bounded != want:
        reason = f"{reason} (clamped to [{lower}, {p.max_replicas}])"
    return Decision(bounded, reason)


def _window(history: History, now: float, seconds: float, latest: int) -> list[int]:
    """Proposals within the last ``seconds``; a zero window is the latest alone."""
    if seconds <= 0:
        return [latest]
    return [r for t, r in history.proposals if now - t <= seconds]
