"""Numbers out of Prometheus text, as the operator, the gateway and the launcher read
them (``llmserve/metrics_scrape.py``), from text a real registry writes."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from llmserve.metrics_scrape import by_series, sum_by_name


@pytest.fixture
def text() -> str:
    registry = CollectorRegistry()
    waiting = Gauge("vllm:num_requests_waiting", "queued", ["model_name"], registry=registry)
    waiting.labels("a").set(3)
    waiting.labels("b").set(4)
    Gauge("llmserve:max_num_seqs", "capacity", registry=registry).set(8)
    Counter("vllm:request_success", "done", registry=registry).inc(5)
    return generate_latest(registry).decode()


def test_each_name_is_summed_over_its_label_sets(text):
    sums = sum_by_name(text)
    assert sums["vllm:num_requests_waiting"] == 7
    assert sums["llmserve:max_num_seqs"] == 8
    assert sums["vllm:request_success_total"] == 5


def test_only_the_names_asked_for(text):
    asked = ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    assert sum_by_name(text, names=asked) == {"vllm:num_requests_waiting": 7.0}


def test_series_by_labels_and_their_sum_by_bare_name(text):
    series = by_series(text)
    assert series['vllm:num_requests_waiting{model_name="a"}'] == 3
    assert series['vllm:num_requests_waiting{model_name="b"}'] == 4
    assert series["vllm:num_requests_waiting"] == 7
    assert series["llmserve:max_num_seqs"] == 8


def test_an_empty_page_has_no_numbers():
    assert sum_by_name("") == {} and by_series("") == {}
