"""Tenants file, rate limits, the fair queue and the engine's fair order: the logic,
driven directly (the HTTP path is in test_gateway_tenants.py)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from llmserve.entrypoints.openai.protocol import APIError
from llmserve.gateway.fairness import FairQueue, Waiter
from llmserve.gateway.ratelimits import RateLimiter
from llmserve.gateway.tenants import Limits, Tenant, TenantsError, TenantsFile, parse_tenants
from llmserve.gateway.usage import UsageTap, ask_for_usage
from tests.sim import add, make_request, make_scheduler, simulate_step

EXAMPLE = """
classes:
  - {name: interactive, priority: 0, queueTimeoutSeconds: 5, maxQueued: 500}
  - {name: batch, priority: 10, queueTimeoutSeconds: 600, maxQueued: 20000, minShare: 0.05}
defaultClass: interactive
tenants:
  - name: acme
    apiKeys: ["sk-acme-1"]
    weight: 2
    classes: [interactive, batch]
    limits: {rpm: 600, tpm: 200000, maxConcurrency: 32}
  - name: beta
    apiKeySha256: ["BETA_SHA"]
""".replace("BETA_SHA", hashlib.sha256(b"sk-beta").hexdigest())


def test_the_issue_example_parses():
    cfg = parse_tenants(EXAMPLE)
    acme = cfg.tenant_for_key("sk-acme-1")
    assert acme.name == "acme" and acme.weight == 2
    assert acme.limits == Limits(rpm=600, tpm=200000, max_concurrency=32)
    assert cfg.tenant_for_key("sk-beta").name == "beta"  # by its SHA-256 only
    assert cfg.tenant_for_key("sk-nobody") is None
    assert cfg.class_for(acme, None).name == "interactive"
    assert cfg.class_for(acme, "batch").min_share == 0.05
    assert [c.name for c in cfg.classes_by_urgency] == ["interactive", "batch"]


def test_a_tenant_cannot_use_a_class_it_was_not_given():
    cfg = parse_tenants(EXAMPLE.replace("apiKeySha256", "classes: [batch]\n    apiKeySha256"))
    beta = cfg.tenants["beta"]
    assert cfg.class_for(beta, None).name == "batch"  # not the default: its own first
    with pytest.raises(APIError) as e:
        cfg.class_for(beta, "interactive")
    assert e.value.status == 403
    with pytest.raises(APIError) as e:
        cfg.class_for(beta, "gold")
    assert e.value.status == 400


@pytest.mark.parametrize("edit, message", [
    (("weight: 2", "weight: 0"), "tenants[0].weight must be > 0"),
    (("classes: [interactive, batch]", "classes: [gold]"), "unknown class 'gold'"),
    (("defaultClass: interactive", "defaultClass: gold"), "defaultClass 'gold'"),
    (("rpm: 600", "rpm: many"), "tenants[0].limits.rpm must be an integer"),
    (('apiKeySha256: ["', 'apiKeySha256: ["zz'), "64-character hex"),
    (("- name: beta", "- name: acme"), "duplicate tenant name 'acme'"),
    (("minShare: 0.05", "minShare: 0.9"), "classes[1].minShare must be >= 0 and <= 0.5"),
    (("maxConcurrency: 32", "maxConcurency: 32"), "unknown field(s) ['maxConcurency']"),
    (("tenants:", "tenants: [\n"), "not valid YAML"),
])
def test_bad_files_say_what_is_wrong(edit, message):
    with pytest.raises(TenantsError) as e:
        parse_tenants(EXAMPLE.replace(*edit))
    assert message in str(e.value)


def test_the_same_key_for_two_tenants_is_refused():
    text = EXAMPLE.replace('apiKeySha256: ["', 'apiKeys: ["sk-acme-1"]\n    apiKeySha256: ["')
    with pytest.raises(TenantsError, match="also a key of 'acme'"):
        parse_tenants(text)


def test_an_invalid_edit_keeps_the_last_good_file(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(EXAMPLE)
    f = TenantsFile(str(path))
    path.write_text(EXAMPLE.replace("weight: 2", "weight: -1"))
    assert f.current().tenants["acme"].weight == 2 and f.reload_errors == 1
    path.write_text(EXAMPLE.replace("weight: 2", "weight: 5"))
    import os
    os.utime(path, ns=(1, 10**18))  # a distinct mtime even on coarse clocks
    assert f.current().tenants["acme"].weight == 5


# --- rate limits ---------------------------------------------------------------------
def tenant(**limits) -> Tenant:
    return Tenant("t", 1.0, ("interactive",), Limits(**limits))


def test_rpm_refuses_with_the_exact_time_a_slot_frees():
    rl, t = RateLimiter(), tenant(rpm=3)
    for now in (0.0, 10.0, 20.0):
        rl.admit(t, 10, now=now)
    with pytest.raises(APIError) as e:
        rl.admit(t, 10, now=30.0)
    err = e.value
    assert err.status == 429 and err.body()["error"]["type"] == "rate_limit_exceeded"
    assert err.headers["Retry-After"] == "30" and err.headers["retry-after-ms"] == "30000"
    assert err.headers["x-ratelimit-limit-requests"] == "3"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(APIError):
        rl.admit(t, 10, now=59.9)
    rl.admit(t, 10, now=60.0)  # the first left the window: exactly when it said


def test_tpm_is_charged_the_estimate_then_corrected_to_the_real_usage():
    rl, t = RateLimiter(), tenant(tpm=1000)
    a = rl.admit(t, 900, now=0.0)
    with pytest.raises(APIError) as e:
        rl.admit(t, 200, now=1.0)
    assert e.value.headers["Retry-After"] == "59"
    rl.release(a, used_tokens=100, served=True, now=1.0)  # it used far less than it might have
    rl.admit(t, 200, now=1.0)
    with pytest.raises(APIError) as e:
        rl.admit(t, 5000, now=2.0)
    assert e.value.status == 400 and "more than tenant 't'" in e.value.message


def test_requests_never_served_are_refunded_and_concurrency_is_capped():
    rl, t = RateLimiter(), tenant(rpm=1, max_concurrency=1)
    a = rl.admit(t, 10, now=0.0)
    with pytest.raises(APIError, match="1 concurrent"):
        rl.admit(t, 10, now=0.5)
    rl.release(a, used_tokens=0, served=False, now=1.0)  # shed from the queue
    rl.admit(t, 10, now=1.0)


# --- the fair queue -----------------------------------------------------------------
def run(coro):
    return asyncio.run(coro)


def classes(text=EXAMPLE):
    return parse_tenants(text).classes_by_urgency


async def drain(fq: FairQueue, waiters: list[Waiter], slots: list[int]) -> list[Waiter]:
    """Dispatch one request at a time (an engine with one free slot), in order."""
    order = []
    for w in waiters:
        fq.submit(w)
    while any(not w.future.done() for w in waiters):
        slots[0] = 1
        fq.dispatch()
        done = [w for w in waiters if w.future.done() and w not in order]
        for w in done:
            fq.started(w)
            fq.finished(w, w.cost)  # served at once, using what it was charged
            order.append(w)
        slots[0] = 0
        await asyncio.sleep(0)
    return order


def token_share(order, tenant, n):
    first = order[:n]
    return sum(w.cost for w in first if w.tenant == tenant) / sum(w.cost for w in first)


@pytest.mark.parametrize("weights, expected", [((1, 1), 1.0), ((2, 1), 2.0)])
def test_backlogged_tenants_share_tokens_by_weight(weights, expected):
    async def main():
        slots = [0]
        fq = FairQueue(classes(), lambda priority: slots[0])
        inter = fq.queues["interactive"].cls
        heavy = [Waiter("heavy", weights[0], inter, 1000) for _ in range(60)]
        light = [Waiter("light", weights[1], inter, 100) for _ in range(400)]
        order = await drain(fq, heavy + light, slots)
        half = 300  # while both are still backlogged
        served = {t: sum(w.cost for w in order[:half] if w.tenant == t)
                  for t in ("heavy", "light")}
        return served["heavy"] / served["light"]
    ratio = run(main())
    assert expected * 0.9 <= ratio <= expected * 1.1


def test_a_client_that_sends_as_soon_as_its_request_ends_keeps_its_share():
    """A tenant whose queue is empty only while its next request is on the way is
    not idle: it keeps its counter (the weight 2:1 share survives closed-loop
    clients that never queue more than they have in flight)."""
    async def main():
        fq = FairQueue(classes(), lambda priority: 0)
        inter = fq.queues["interactive"].cls
        heavy = [Waiter("heavy", 1, inter, 100) for _ in range(5)]
        for w in heavy:
            fq.submit(w)
        first = Waiter("light", 2, inter, 100)
        fq.submit(first)
        q = fq.queues["interactive"]
        q.pop_fairest()  # heavy's first, then light's (both counters start equal)
        served = q.pop_fairest()
        assert served is first
        before = q.counters["light"]
        fq.submit(Waiter("light", 2, inter, 100))  # its next, while `first` still runs
        return before, q.counters["light"], q.counters["heavy"]
    before, after, heavy = run(main())
    assert after == before < heavy  # not lifted to heavy's counter


def test_a_tenant_back_from_idle_gets_no_banked_credit():
    async def main():
        slots = [0]
        fq = FairQueue(classes(), lambda priority: slots[0])
        inter = fq.queues["interactive"].cls
        await drain(fq, [Waiter("busy", 1, inter, 100) for _ in range(50)], slots)
        # "idle" was away while "busy" used 5,000 tokens; now both are backlogged.
        order = await drain(fq, [Waiter("busy", 1, inter, 100) for _ in range(20)] +
                            [Waiter("idle", 1, inter, 100) for _ in range(20)], slots)
        return [w.tenant for w in order[:10]]
    first = run(main())
    assert 4 <= first.count("idle") <= 6, first  # alternating, not ten in a row


def test_batch_gets_its_min_share_under_an_interactive_flood():
    async def main():
        slots = [0]
        fq = FairQueue(classes(), lambda priority: slots[0])
        inter, batch = fq.queues["interactive"].cls, fq.queues["batch"].cls
        order = await drain(fq, [Waiter("a", 1, inter, 10) for _ in range(400)] +
                            [Waiter("b", 1, batch, 10) for _ in range(100)], slots)
        return [w.cls.name for w in order[:400]]
    names = run(main())
    share = names.count("batch") / len(names)
    assert 0.04 <= share <= 0.07, share  # minShare 0.05, not strict starvation


def test_a_full_queue_sheds_batch_first_then_the_heaviest_tenant():
    async def main():
        text = EXAMPLE.replace("maxQueued: 500", "maxQueued: 3")
        fq = FairQueue(classes(text), lambda priority: 0)
        inter, batch = fq.queues["interactive"].cls, fq.queues["batch"].cls
        b = Waiter("x", 1, batch, 10)
        fq.submit(b)
        flood = [Waiter("flood", 1, inter, 10) for _ in range(3)]
        for w in flood:
            fq.submit(w)
        fq.submit(Waiter("calm", 1, inter, 10))  # full: batch is still queued...
        calm2 = Waiter("calm", 1, inter, 10)
        fq.submit(calm2)
        shed = [w for w in flood if w.future.done()]
        with pytest.raises(APIError) as e:  # calm has as many queued as flood now
            fq.submit(Waiter("flood", 1, inter, 10))
        return b, shed, e.value
    b, shed, err = run(main())
    assert isinstance(b.future.exception(), APIError)  # the batch request went first
    assert b.future.exception().status == 503
    assert len(shed) == 1 and shed[0].future.exception().type == "server_overloaded"
    assert err.status == 503 and "Retry-After" in err.headers


def test_queue_timeout_and_a_client_that_leaves():
    async def main():
        text = EXAMPLE.replace("queueTimeoutSeconds: 5", "queueTimeoutSeconds: 0.05")
        fq = FairQueue(classes(text), lambda priority: 0)
        inter = fq.queues["interactive"].cls
        w = Waiter("a", 1, inter, 10)
        fq.submit(w)
        with pytest.raises(APIError) as e:
            await fq.wait(w)
        assert e.value.status == 503 and fq.size == 0
        w2 = Waiter("a", 1, inter, 10)
        fq.submit(w2)
        task = asyncio.create_task(fq.wait(w2))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return fq.size
    assert run(main()) == 0


# --- usage read from responses ------------------------------------------------------
def test_the_usage_chunk_asked_for_by_the_gateway_is_removed():
    payload = {"stream": True}
    assert ask_for_usage(payload) and payload["stream_options"] == {"include_usage": True}
    tap = UsageTap(stream=True, drop_usage_chunk=True)
    events = (b'data: {"choices": [{"text": "hi"}], "usage": null}\n\n'
              b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,'
              b' "total_tokens": 5}}\n\ndata: [DONE]\n\n')
    out = b"".join(tap.feed(events[i:i + 7]) for i in range(0, len(events), 7)) + tap.finish()
    assert tap.total_tokens == 5
    assert out == b'data: {"choices": [{"text": "hi"}], "usage": null}\n\ndata: [DONE]\n\n'
    assert not ask_for_usage({"stream": True, "stream_options": {"include_usage": True}})


# --- the engine's fair order --------------------------------------------------------
def test_the_engine_admits_the_least_served_tenant_first():
    sched = make_scheduler(num_blocks=256, block_size=4, max_num_seqs=1,
                           max_num_batched_tokens=64)
    hogs = []
    for _ in range(6):
        req = make_request(prompt_len=8, max_tokens=2)
        req.tenant = "hog"
        hogs.append(add(sched, req))
    guest = make_request(prompt_len=8, max_tokens=2)
    guest.tenant = "guest"
    add(sched, guest)  # arrived last
    order = []
    while sched.has_work():
        batch = sched.schedule()
        order += [s.request.tenant for s in batch.seqs if s.num_computed_tokens == 0]
        simulate_step(sched, batch)
    assert order.index("guest") == 1, order  # right after the hog's first, not last
    # tokens computed: the prompt and every sampled token but the last
    assert sched.shares.tokens_served == {"hog": 6 * 9, "guest": 9}
    assert sched.shares.active == {}


def test_urgent_work_takes_a_place_in_a_full_batch():
    """Under priority scheduling, batch work holding every place under max_num_seqs
    is preempted for an interactive request, which starts in the very next step."""
    sched = make_scheduler(num_blocks=256, block_size=4, max_num_seqs=2,
                           max_num_batched_tokens=64, scheduling_policy="priority")
    batch = [add(sched, make_request(prompt_len=8, max_tokens=50, priority=10))
             for _ in range(2)]
    simulate_step(sched, sched.schedule())
    urgent = add(sched, make_request(prompt_len=8, max_tokens=2, priority=0))
    step = sched.schedule()
    assert urgent.sequences[0] in step.seqs
    assert len(step.preempted) == 1 and step.preempted[0].request in batch
    while sched.has_work():
        simulate_step(sched, sched.schedule())
    assert all(r.finished for r in batch)  # the preempted one came back and finished


def test_a_recomputed_sequence_is_not_charged_twice():
    sched = make_scheduler(num_blocks=256, block_size=4, max_num_batched_tokens=64)
    req = make_request(prompt_len=8, max_tokens=4)
    req.tenant = "t"
    add(sched, req)
    simulate_step(sched, sched.schedule())  # prefill: 8 tokens
    simulate_step(sched, sched.schedule())  # one decode
    seq = req.sequences[0]
    sched.running.remove(seq)  # preempted for recompute, as the scheduler does
    sched.bm.free(seq)
    seq.reset_for_recompute()
    sched.add(seq)
    while sched.has_work():
        simulate_step(sched, sched.schedule())
    # prompt + every sampled token but the last, each charged once
    assert sched.shares.tokens_served == {"t": 8 + 3}
