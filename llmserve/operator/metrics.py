"""The operator's own Prometheus metrics: what the autoscaler saw and decided, per
LLMDeployment and engine pool, and the reconciles that failed.

Every series carries ``namespace`` and ``llmdeployment`` (the LLMDeployment's, not the
operator pod's: the chart's monitors scrape the operator with ``honorLabels``) and,
for the autoscaler's, ``pool`` (``engine``: the main, decode or colocated, pool;
``prefill``: spec.prefill's). The alert ``LLMServeAutoscalerAtMaxReplicas`` and the
overview dashboard read these names; tests check them against a real operator.

Served by ``llmserve operator --metrics-port`` from its own registry, so nothing the
operator happens to import adds series here.
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from llmserve.operator.autoscaler import Decision, Observation, Policy

REGISTRY = CollectorRegistry()
_POOL = ["namespace", "llmdeployment", "pool"]


def _gauge(name: str, doc: str) -> Gauge:
    return Gauge(f"llmserve_operator_autoscaler_{name}", doc, _POOL, registry=REGISTRY)


DESIRED = _gauge("desired_replicas", "Replicas the autoscaler decided on (spec.replicas "
                 "without autoscaling)")
CURRENT = _gauge("current_replicas", "Replicas the engine Deployment has")
MIN = _gauge("min_replicas", "autoscaling.minReplicas (the prefill pool's own bound)")
MAX = _gauge("max_replicas", "autoscaling.maxReplicas (the prefill pool's own bound)")
QUEUE = _gauge("queue_depth_per_engine", "Requests waiting in the pool's engines, per "
               "ready engine: the queue signal")
QUEUE_TARGET = _gauge("target_queue_depth", "autoscaling.targetQueueDepth")
KV = _gauge("kv_cache_usage", "KV-cache use averaged over the pool's ready engines "
            "(0-1): the KV signal")
KV_TARGET = _gauge("target_kv_cache_usage", "autoscaling.targetKVUtilization (the "
                   "prefill pool has none)")
PROMPT = _gauge("waiting_prompt_tokens_per_engine", "Prompt tokens waiting to be "
                "prefilled, per ready engine: the prefill pool's signal")
PROMPT_TARGET = _gauge("target_waiting_prompt_tokens", "spec.prefill."
                       "targetWaitingPromptTokens")
READY = _gauge("ready_engines", "Engines of the pool that answered the scrape")
REASON = Gauge("llmserve_operator_autoscaler_decision", "1 for the reason of the latest "
               "decision (its kind: numbers are in the LLMDeployment's events)",
               [*_POOL, "reason"], registry=REGISTRY)
DECISIONS = Counter("llmserve_operator_autoscaler_decisions", "Autoscaler decisions by "
                    "reason kind", [*_POOL, "reason"], registry=REGISTRY)
SCALES = Counter("llmserve_operator_autoscaler_scale_events", "Decisions that changed "
                 "the replicas, by direction", [*_POOL, "direction"], registry=REGISTRY)
RECONCILE_ERRORS = Counter("llmserve_operator_reconcile_errors", "Reconciles that failed, "
                           "by reason (InvalidSpec, InvalidTenants, ApplyFailed)",
                           ["namespace", "llmdeployment", "reason"], registry=REGISTRY)

# The reason's kind: decide()'s reason text with its numbers left out (a bounded label).
_KINDS = [("requests waiting at zero", "demand_at_zero"), ("below minReplicas", "below_min"),
          ("idle at zero", "idle_at_zero"), ("metrics unavailable", "metrics_unavailable"),
          ("scale-down held", "scale_down_held"), ("idle for", "scale_to_zero"),
          ("within tolerance", "within_tolerance"), ("queue depth", "queue_depth"),
          ("KV utilisation", "kv_cache_usage"), ("waiting prompt tokens", "waiting_prompt_tokens")]


def reason_kind(reason: str) -> str:
    """``decide()``'s reason as a label value: one of a fixed set, ``_clamped`` added
    when the bounds cut the proposal (``clamped to [min, max]``)."""
    kind = next((k for text, k in _KINDS if text in reason), "other")
    return kind + ("_clamped" if re.search(r"\(clamped to ", reason) else "")


def record_decision(namespace: str, name: str, pool: str, current: int, policy: Policy,
                    obs: Observation | None, decision: Decision) -> None:
    """One autoscaler pass of one pool: the bounds and targets it used, the signals
    it saw (left as they were when the engines could not be scraped) and its choice."""
    labels = (namespace, name, pool)
    DESIRED.labels(*labels).set(decision.replicas)
    MIN.labels(*labels).set(policy.min_replicas)
    MAX.labels(*labels).set(policy.max_replicas)
    QUEUE_TARGET.labels(*labels).set(policy.target_queue_depth)
    for gauge, target in ((KV_TARGET, policy.target_kv_utilization),
                          (PROMPT_TARGET, policy.target_waiting_prompt_tokens)):
        if target is not None:
            gauge.labels(*labels).set(target)
    record_observation(namespace, name, pool, obs)
    kind = reason_kind(decision.reason)
    _forget(REASON, labels)
    REASON.labels(*labels, kind).set(1)
    DECISIONS.labels(*labels, kind).inc()
    if decision.replicas != current:
        SCALES.labels(*labels, "up" if decision.replicas > current else "down").inc()


def record_observation(namespace: str, name: str, pool: str, obs: Observation | None) -> None:
    """The signals of one pool (also without autoscaling: the dashboards show them)."""
    if obs is None:
        return
    labels = (namespace, name, pool)
    per_engine = max(obs.ready_replicas, 1)
    READY.labels(*labels).set(obs.ready_replicas)
    QUEUE.labels(*labels).set(obs.waiting / per_engine)
    KV.labels(*labels).set(obs.kv_usage)
    PROMPT.labels(*labels).set(obs.waiting_prompt_tokens / per_engine)


def record_replicas(namespace: str, name: str, pool: str, desired: int, current: int) -> None:
    """What reconcile applied and what the pool's Deployment has."""
    DESIRED.labels(namespace, name, pool).set(desired)
    CURRENT.labels(namespace, name, pool).set(current)


def record_reconcile_error(namespace: str, name: str, reason: str) -> None:
    RECONCILE_ERRORS.labels(namespace, name, reason).inc()


def forget(namespace: str, name: str) -> None:
    """Drop a deleted LLMDeployment's series (they would read as stuck forever)."""
    for metric in (DESIRED, CURRENT, MIN, MAX, QUEUE, QUEUE_TARGET, KV, KV_TARGET, PROMPT,
                   PROMPT_TARGET, READY, REASON, DECISIONS, SCALES, RECONCILE_ERRORS):
        _forget(metric, (namespace, name))


def _forget(metric, prefix: tuple[str, ...]) -> None:
    """Remove every child of ``metric`` whose label values start with ``prefix``."""
    for values in list(metric._metrics):  # noqa: SLF001 - prometheus_client has no prefix removal
        if values[:len(prefix)] == prefix:
            metric.remove(*values)


def serve(port: int, host: str = "0.0.0.0") -> None:
    """/metrics on ``port`` (a daemon thread: it lives as long as the operator)."""
    start_http_server(port, addr=host, registry=REGISTRY)
