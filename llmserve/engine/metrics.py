"""Prometheus collectors under vLLM's metric names, so dashboards, KEDA rules, the
Gateway API Inference Extension and our own gateway/autoscaler read us unchanged.

The engine pushes what each step reports (``record``): the scheduler's state and
running totals (step_stats.py) and what the step's outputs add (the output processor's
``IterationStats``). Nothing here reads the engine."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from llmserve.engine.output_processor import IterationStats
from llmserve.engine.step_stats import SchedulerStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 max_num_seqs: int | None = None, max_loras: int | None = None):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self.max_loras = max_loras
        self._scheduler_metrics(max_num_seqs)
        self._request_metrics()
        self._tenant_and_overload_metrics()
        self._kv_transfer_metrics(self.registry)
        self._feature_metrics()
        self.aborted = 0
        self._synced = {"queries": 0, "hits": 0, "preemptions": 0, "swap_outs": 0,
                        "aborted": 0, "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}

    # --- one labelled child per metric (label model_name) ---------------------------------
    def _gauge(self, name: str, doc: str):
        return Gauge(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _counter(self, name: str, doc: str):
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _hist(self, name: str, doc: str):
        return Histogram(name, doc, ["model_name"], buckets=LATENCY_BUCKETS,
                         registry=self.registry).labels(self.model_name)

    def _scheduler_metrics(self, max_num_seqs: int | None) -> None:
        self.running = self._gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = self._gauge("vllm:num_requests_waiting",
                                   "Requests waiting to be scheduled.")
        self.swapped = self._gauge("vllm:num_requests_swapped", "Requests swapped out to CPU.")
        self.kv_usage = self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100%.")
        # What the gateway caps its in-flight requests at with tenants (endpoints.py):
        # more would wait here, outside the gateway's fair queue.
        self.max_num_seqs = self._gauge("llmserve:max_num_seqs",
                                        "Sequences the engine runs at once (--max-num-seqs).")
        if max_num_seqs is not None:
            self.max_num_seqs.set(max_num_seqs)
        self.prefix_queries = self._counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = self._counter("vllm:prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        self.preemptions = self._counter("vllm:num_preemptions", "Preempted sequences.")
        self.swap_outs = self._counter("llmserve:swapped_out_sequences",
                                       "Sequences preempted by swapping their KV blocks to CPU.")

    def _request_metrics(self) -> None:
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Generated tokens.")
        self.success = Counter("vllm:request_success", "Finished requests.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = self._hist("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = self._hist("vllm:inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = self._hist("vllm:e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = self._hist("vllm:request_queue_time_seconds",
                                     "Arrival to first schedule.")
        self.step_duration = Histogram(
            "llmserve:step_duration_seconds",
            "Engine step durations: measured (kind=actual) and as the cost model predicted "
            "them when it scheduled the step (kind=predicted).",
            ["model_name", "kind"], buckets=LATENCY_BUCKETS, registry=self.registry)

    def _tenant_and_overload_metrics(self) -> None:
        self.tenant_tokens = Counter(
            "llmserve:tenant_tokens", "Tokens computed (prompt and output) per tenant, as "
            "the gateway named it; the engine's fair order among tenants is by these.",
            ["model_name", "tenant"], registry=self.registry)
        self._tenant_synced: dict[str, int] = {}
        self.overloaded = Counter(
            "llmserve:overload_rejections",
            "Requests answered 503 server_overloaded: reason=queue_full (max_waiting) or "
            "queue_delay (max_queue_delay).", ["model_name", "reason"], registry=self.registry)

    def _feature_metrics(self) -> None:
        # Speculative decoding (spec_decode/); prometheus_client adds the _total suffix.
        self.spec_drafts = self._counter("vllm:spec_decode_num_drafts",
                                         "Sequence steps verified with a draft.")
        self.spec_draft_tokens = self._counter("vllm:spec_decode_num_draft_tokens",
                                               "Draft tokens proposed and verified.")
        self.spec_accepted_tokens = self._counter("vllm:spec_decode_num_accepted_tokens",
                                                  "Draft tokens the target model accepted.")
        # Multi-LoRA, vLLM's shape (the Gateway API Inference Extension's LoRA affinity
        # reads it): one series, labelled with the adapters running and waiting
        # (comma-separated names), whose value is when it was set.
        self.lora_info = Gauge(
            "vllm:lora_requests_info", "Running and waiting LoRA adapters, by name.",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=self.registry)
        self._lora_labels: tuple | None = None

    def _kv_transfer_metrics(self, r: CollectorRegistry) -> None:
        """P/D (engine/disagg.py): KV moved between engines, and what a prefill pool's
        autoscaler reads."""
        labels = ["model_name"]
        self.kv_tokens = Counter(
            "llmserve:kv_transfer_tokens", "Prompt tokens whose KV moved between engines: "
            "direction=sent (prefill engine) or received (decode engine).",
            [*labels, "direction"], registry=r)
        self.kv_seconds = Histogram(
            "llmserve:kv_transfer_seconds", "Duration of one KV import (decode engine).",
            labels, buckets=LATENCY_BUCKETS, registry=r).labels(self.model_name)
        self.kv_failures = Counter(
            "llmserve:kv_transfer_failures", "KV transfers that did not happen (the decode "
            "engine prefilled itself; a prefill engine counts leases that expired unread).",
            [*labels, "reason"], registry=r)
        self.kv_blocks_held = Gauge(
            "llmserve:kv_transfer_blocks_held", "KV blocks a prefill engine holds for "
            "decode engines to read.", labels, registry=r).labels(self.model_name)
        self.waiting_prompt_tokens = Gauge(
            "llmserve:num_waiting_prompt_tokens", "Prompt tokens not computed yet, of "
            "waiting and prefilling requests.", labels, registry=r).labels(self.model_name)

    def _observe_loras(self, running: list[str], waiting: list[str]) -> None:
        labels = (str(self.max_loras), ",".join(running), ",".join(waiting))
        if labels != self._lora_labels:  # one series: the old label set goes
            self.lora_info.clear()
            self._lora_labels = labels
        self.lora_info.labels(*labels).set(time.time())

    def kv_sent(self, tokens: int) -> None:
        self.kv_tokens.labels(self.model_name, "sent").inc(tokens)

    def kv_received(self, tokens: int, seconds: float) -> None:
        self.kv_tokens.labels(self.model_name, "received").inc(tokens)
        self.kv_seconds.observe(seconds)

    def kv_failure(self, reason: str, count: int = 1) -> None:
        self.kv_failures.labels(self.model_name, reason).inc(count)

    def on_overload(self, reason: str) -> None:
        self.overloaded.labels(self.model_name, reason).inc()

    def record(self, stats: SchedulerStats, iteration: IterationStats | None = None) -> None:
        """One step's (or an idle loop's) report."""
        if stats.step_seconds is not None:
            actual, predicted = stats.step_seconds
            self.step_duration.labels(self.model_name, "actual").observe(actual)
            if predicted is not None:
                self.step_duration.labels(self.model_name, "predicted").observe(predicted)
        if iteration is not None:
            self._record_iteration(iteration)
        self._record_scheduler(stats)

    def _record_iteration(self, it: IterationStats) -> None:
        self.generation_tokens.inc(it.generation_tokens)
        self.prompt_tokens.inc(it.prompt_tokens)
        for value in it.ttfts:
            self.ttft.observe(value)
        for value in it.queue_times:
            self.queue_time.observe(value)
        for value in it.itls:
            self.itl.observe(value)
        for value in it.e2e_latencies:
            self.e2e.observe(value)
        for reason in it.finish_reasons:
            self.success.labels(self.model_name, reason).inc()

    def _record_scheduler(self, s: SchedulerStats) -> None:
        self.running.set(s.num_running_reqs)
        self.waiting.set(s.num_waiting_reqs)
        self.swapped.set(s.num_swapped_seqs)
        self.kv_usage.set(s.kv_cache_usage)
        self.waiting_prompt_tokens.set(s.num_waiting_prompt_tokens)
        self._sync(self.prefix_queries, "queries", s.prefix_cache_queries)
        self._sync(self.prefix_hits, "hits", s.prefix_cache_hits)
        self._sync(self.preemptions, "preemptions", s.num_preemptions)
        self._sync(self.swap_outs, "swap_outs", s.num_swapped_out)
        self._sync(self.spec_drafts, "drafts", s.spec_drafts)
        self._sync(self.spec_draft_tokens, "draft_tokens", s.spec_draft_tokens)
        self._sync(self.spec_accepted_tokens, "accepted_tokens", s.spec_accepted_tokens)
        if s.running_loras is not None:
            self._observe_loras(s.running_loras, s.waiting_loras)
        for tenant, total in s.tenant_tokens.items():
            done = self._tenant_synced.get(tenant, 0)
            if total > done:
                self.tenant_tokens.labels(self.model_name, tenant).inc(total - done)
                self._tenant_synced[tenant] = total
        if self.aborted > self._synced["aborted"]:
            self.success.labels(self.model_name, "abort").inc(
                self.aborted - self._synced["aborted"])
            self._synced["aborted"] = self.aborted

    def _sync(self, counter, key: str, total: int) -> None:
        if total > self._synced[key]:
            counter.inc(total - self._synced[key])
            self._synced[key] = total
