"""Routing policies and discovery parsing: pure functions, no network."""

from __future__ import annotations

from collections import Counter

import pytest

from llmserve.gateway.discovery import urls_from_slices
from llmserve.gateway.endpoints import EndpointPool, parse_engine_metrics
from llmserve.gateway.prefix import prefix_key
from llmserve.gateway.routing import (
    Candidate,
    HashRing,
    LeastLoadPolicy,
    PrefixHashPolicy,
    RoundRobinPolicy,
    make_policy,
)

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]
KEYS = [f"tenant-{i} system prompt" for i in range(5000)]


def test_adding_a_fifth_endpoint_moves_about_a_fifth_of_keys():
    four, five = HashRing(URLS[:4]), HashRing(URLS)
    moved = [k for k in KEYS if four.owner(k) != five.owner(k)]
    assert all(five.owner(k) == URLS[4] for k in moved), "keys only move to the new endpoint"
    assert 0.13 < len(moved) / len(KEYS) < 0.27


def test_ring_spreads_keys_evenly():
    owners = Counter(HashRing(URLS).owner(k) for k in KEYS)
    assert max(owners.values()) / min(owners.values()) < 1.5


def test_two_independent_routers_agree_on_every_key():
    a, b = PrefixHashPolicy(), PrefixHashPolicy()
    cands_a = [Candidate(u) for u in URLS]
    cands_b = [Candidate(u) for u in reversed(URLS)]  # order of discovery must not matter
    assert all(a.choose(cands_a, k).url == b.choose(cands_b, k).url for k in KEYS[:500])


def test_bounded_load_under_a_hot_key():
    policy = PrefixHashPolicy(load_factor=1.25)
    cands = {u: Candidate(u) for u in URLS}
    chosen = Counter()
    for _ in range(100):  # 100 concurrent requests, all with the same prefix
        url = policy.choose(list(cands.values()), "the hot prefix").url
        cands[url].in_flight += 1
        chosen[url] += 1
        bound = policy.bound(list(cands.values()))
        assert all(c.in_flight <= bound for c in cands.values())
    owner = HashRing(URLS).owner("the hot prefix")
    assert chosen[owner] == max(chosen.values())
    assert max(chosen.values()) <= 100 / 5 * 1.25 + 1


def test_saturated_endpoints_are_skipped_unless_all_are():
    policy = PrefixHashPolicy()
    key = "some prefix"
    owner = HashRing(URLS).owner(key)
    cands = [Candidate(u, saturated=(u == owner)) for u in URLS]
    decision = policy.choose(cands, key)
    assert decision.url != owner and decision.reason == "bounded"
    all_busy = [Candidate(u, saturated=True) for u in URLS]
    assert policy.choose(all_busy, key).url == owner


def test_least_load_and_round_robin():
    cands = [Candidate(u, in_flight=i) for i, u in enumerate(URLS)]
    assert LeastLoadPolicy().choose(cands).url == URLS[0]
    rr = RoundRobinPolicy()
    assert [rr.choose(cands).url for _ in range(10)] == sorted(URLS) * 2
    with pytest.raises(ValueError):
        make_policy("random")


def test_prefix_key_uses_system_and_first_user_message():
    chat = {"model": "m", "messages": [{"role": "system", "content": "You are a pirate."},
                                       {"role": "user", "content": "hello"},
                                       {"role": "assistant", "content": "arr"},
                                       {"role": "user", "content": "more"}]}
    same = {"model": "m", "messages": [{"role": "system", "content": "You are a pirate."},
                                       {"role": "user", "content": "hello"}]}
    other = {"model": "m", "messages": [{"role": "system", "content": "You are a poet."},
                                        {"role": "user", "content": "hello"}]}
    assert prefix_key(chat) == prefix_key(same) != prefix_key(other)
    long_a = {"prompt": "x" * 100 + "tail a"}
    long_b = {"prompt": "x" * 100 + "tail b"}
    assert prefix_key(long_a) == prefix_key(long_b)
    assert prefix_key(long_a, max_chars=200) != prefix_key(long_b, max_chars=200)
    assert prefix_key({"prompt": [1, 2, 3]}) != prefix_key({"prompt": [1, 2, 4]})
    assert prefix_key("garbage") == ""
    # Malformed content parts (the API fuzzer's: a list or a number as "text") get a
    # key, not a 500; the engine answers them with a 400.
    for text in ([], 1.5, None, {"a": 1}):
        parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": text}]},
                              {"role": "user", "content": [{"text": text}, {"text": "hi"}]}]}
        assert prefix_key(parts) == prefix_key({"messages": [{"role": "user",
                                                              "content": "hi"}]})


def test_endpoint_slices_to_urls():
    slices = [
        {"ports": [{"name": "http", "port": 8000}],
         "endpoints": [{"addresses": ["10.1.0.5"], "conditions": {"ready": True}},
                       {"addresses": ["10.1.0.6"], "conditions": {"ready": False}},
                       {"addresses": ["10.1.0.7"], "conditions": {"ready": True,
                                                                  "terminating": True}},
                       {"addresses": ["10.1.0.8"]}]},
        {"ports": [{"name": "http", "port": 8000}],
         "endpoints": [{"addresses": ["fd00::9"], "conditions": {"ready": True}}]},
        {"ports": None, "endpoints": [{"addresses": ["10.9.9.9"]}]},
    ]
    assert urls_from_slices(slices) == ["http://10.1.0.5:8000", "http://10.1.0.8:8000",
                                        "http://[fd00::9]:8000"]
    assert urls_from_slices(slices, port_name="metrics") == []


def test_pool_membership_and_saturation():
    pool = EndpointPool(max_waiting=4, max_kv_usage=0.9)
    pool.set_urls(URLS[:3])
    pool.endpoints[URLS[0]].waiting = 10
    pool.endpoints[URLS[1]].kv_usage = 0.95
    sat = {c.url: c.saturated for c in pool.candidates()}
    assert sat == {URLS[0]: True, URLS[1]: True, URLS[2]: False}
    pool.failed(URLS[2])
    assert sorted(c.url for c in pool.candidates()) == URLS[:2]
    pool.set_urls(URLS[3:])
    assert sorted(pool.endpoints) == URLS[3:]


def test_parse_engine_metrics_sums_label_sets():
    text = ('# TYPE vllm:num_requests_waiting gauge\n'
            'vllm:num_requests_waiting{model_name="a"} 3.0\n'
            'vllm:num_requests_waiting{model_name="b"} 2.0\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\n'
            'vllm:kv_cache_usage_perc{model_name="a"} 0.5\n')
    assert parse_engine_metrics(text) == {"vllm:num_requests_waiting": 5.0,
                                          "vllm:kv_cache_usage_perc": 0.5}
