"""Static vs continuous batching, and the latency cap (--target-itl-ms).

Static batching is the baseline the design's headline is measured against, so it must
be what static servers do (a batch runs to its end; nothing joins it) and differ from
continuous batching in scheduling only (same outputs). The cap must keep every
predicted step under the target whenever the step can be split to fit, and its cost
model must learn a step's cost from measurements."""

from __future__ import annotations

import random
import urllib.request

import numpy as np
import pytest

from llmserve import LLM, SamplingParams
from llmserve.core.request import SequenceStatus
from llmserve.core.sched.cost_model import StepCostModel
from tests.server_proc import ServerProcess, scrape
from tests.sim import add, make_request, make_scheduler, simulate_step


def run_steps(llm: LLM, prompts, params):
    """Run to completion by hand; per request: (first scheduled step, finish step)."""
    engine = llm.engine
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, params)]
    reqs = {i: engine.requests[i] for i in ids}
    start, end, outputs, step = {}, {}, {}, 0
    max_running = 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            if out.finished:
                end[out.request_id] = step
                outputs[out.request_id] = [o.token_ids for o in out.outputs]
        for i, r in reqs.items():
            if r.first_scheduled_time is not None and i not in start:
                start[i] = step
        max_running = max(max_running, len(engine.scheduler.running))
    return [outputs[i] for i in ids], [(start[i], end[i]) for i in ids], max_running


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(5, 60))] for _ in range(11)]
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, seed=i,
                             max_tokens=rng.randint(2, 30), ignore_eos=True)
              for i in range(11)]
    return prompts, params


def test_static_batches_run_to_their_end_and_match_continuous(tiny_llama, workload):
    prompts, params = workload
    kw = dict(kv_cache_memory=64 << 20, max_num_seqs=4, max_num_batched_tokens=512)
    static_out, spans, max_running = run_steps(LLM(str(tiny_llama), batching="static", **kw),
                                               prompts, params)
    cont_out, cont_spans, _ = run_steps(LLM(str(tiny_llama), **kw), prompts, params)
    assert static_out == cont_out  # scheduling changes, tokens do not
    assert max_running == 4
    # Batches: requests that started in the same step. None starts before every
    # member of the batch in front of it has finished.
    by_start: dict[int, list[int]] = {}
    for s, e in spans:
        by_start.setdefault(s, []).append(e)
    starts = sorted(by_start)
    assert len(starts) == 3  # 11 requests, batches of 4, 4, 3
    for prev, nxt in zip(starts, starts[1:]):
        assert nxt > max(by_start[prev]), (prev, nxt, by_start)
    # Continuous batching admits into a running batch (that is the point).
    assert any(cs > min(e for _, e in cont_spans) for cs, _ in cont_spans)


def test_static_reserves_prompt_plus_max_tokens_so_it_never_preempts(tiny_llama, workload):
    prompts, params = workload
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K+V x layers x block x kv heads x dim x fp32
    llm = LLM(str(tiny_llama), batching="static", max_num_seqs=8,
              kv_cache_memory=12 * block_bytes, max_num_batched_tokens=512)
    _, _, max_running = run_steps(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions == 0
    assert max_running < 8  # the reservation, not max_num_seqs, bounded the batches
    llm.engine.block_manager.check_all_free()


def test_an_aborted_member_does_not_hold_up_the_next_static_batch():
    sched = make_scheduler(num_blocks=64, block_size=4, batching="static", max_num_seqs=2,
                           max_num_batched_tokens=8)
    first = [add(sched, make_request(12, 3)) for _ in range(2)]  # one chunk at a time
    later = add(sched, make_request(4, 2))
    simulate_step(sched, sched.schedule())  # the first member starts; the second waits
    sched.finish(first[1].sequences[0], SequenceStatus.FINISHED_ABORTED)
    for _ in range(20):
        if not sched.has_work():
            break
        simulate_step(sched, sched.schedule())
    assert first[0].finished and later.finished
    sched.bm.check_all_free()


# --- the cost model ------------------------------------------------------------------------
TRUE = np.array([0.004, 1e-4, 2e-6, 3e-4])  # s: per step, token, KV token read, sequence


def synthetic(tokens, kv, seqs):
    return float(TRUE @ np.array([1, tokens, kv, seqs]))


def test_cost_model_refits_on_prefills_and_every_few_decode_steps():
    """The least-squares fit runs after every step with prefill (those separate the
    per-token cost from the per-sequence one) and every REFIT_EVERY decode-only steps."""
    from llmserve.core.sched.cost_model import REFIT_EVERY
    model = StepCostModel()
    for i in range(20):  # a warmed-up model
        model.observe(64 + i, 2_000, 4, synthetic(64 + i, 2_000, 4))
    fitted = model.coef.copy()
    for i in range(REFIT_EVERY - 1):  # decode-only steps, slower than the model says
        model.observe(8, 2_000 + i, 8, 10 * synthetic(8, 2_000, 8))
    assert np.array_equal(model.coef, fitted)
    model.observe(8, 2_100, 8, 10 * synthetic(8, 2_000, 8))
    assert not np.array_equal(model.coef, fitted)
    fitted = model.coef.copy()
    model.observe(300, 2_000, 4, synthetic(300, 2_000, 4))  # a prefill: at once
    assert not np.array_equal(model.coef, fitted)


def test_cost_model_converges_on_a_noisy_synthetic_cost():
    rng = np.random.default_rng(0)
    model = StepCostModel()
    assert not model.ready
    for _ in range(600):
        seqs = int(rng.integers(1, 64))
        tokens = seqs + int(rng.integers(0, 2) * rng.integers(1, 1024))
        kv = seqs * int(rng.integers(16, 2000))
        model.observe(tokens, kv, seqs, synthetic(tokens, kv, seqs) * rng.normal(1, 0.05))
    assert model.ready and (model.coef >= 0).all()
    np.testing.assert_allclose(model.coef[1:], TRUE[1:], rtol=0.15)
    assert abs(model.coef[0] - TRUE[0]) < 0.0015  # the intercept is the noisiest term
    for tokens, kv, seqs in [(1, 100, 1), (512, 40_000, 32), (64, 5_000, 64)]:
        assert model.predict(tokens, kv, seqs) == pytest.approx(synthetic(tokens, kv, seqs),
                                                                rel=0.05)


def test_least_squares_drops_a_negative_coefficient_and_refits_the_rest():
    """Seconds that fall as one feature grows (noise, in a real step) must not price
    that work as a saving: its coefficient is 0 and the others are the least-squares
    fit without it (decay 1: plain least squares)."""
    from llmserve.core.sched.least_squares import DecayedLeastSquares
    rng = np.random.default_rng(2)
    x = np.column_stack([np.ones(40), rng.uniform(1, 10, 40), rng.uniform(1, 10, 40)])
    y = x @ np.array([1.0, 0.5, -0.1]) + rng.normal(0, 0.01, 40)
    fit = DecayedLeastSquares(3, decay=1.0, ridge=1e-12)
    for row, seconds in zip(x, y):
        fit.add(row, seconds)
    coef = fit.solve()
    assert coef[2] == 0.0 and (coef >= 0).all()
    np.testing.assert_allclose(coef[:2], np.linalg.lstsq(x[:, :2], y, rcond=None)[0],
                               rtol=1e-6)


def fitted_model() -> StepCostModel:
    model = StepCostModel()
    rng = np.random.default_rng(1)
    for _ in range(50):
        seqs = int(rng.integers(1, 32))
        tokens, kv = seqs + int(rng.integers(0, 600)), seqs * int(rng.integers(10, 900))
        model.observe(tokens, kv, seqs, synthetic(tokens, kv, seqs))
    return model


@pytest.mark.parametrize("seed", range(4))
def test_the_cap_keeps_every_splittable_step_under_the_target(seed):
    rng = random.Random(seed)
    target_ms = 40.0
    sched = make_scheduler(num_blocks=4000, block_size=16, target_itl_ms=target_ms,
                           max_num_batched_tokens=2048, max_num_seqs=64,
                           enable_prefix_caching=False)
    sched.cost_model = fitted_model()
    reqs, chunks, step = [], [], 0
    while step < 5000 and (step < 40 or sched.has_work()):
        step += 1
        if step < 40 and rng.random() < 0.5:  # long prompts keep arriving among decodes
            long_prompt = rng.random() < 0.3
            reqs.append(add(sched, make_request(rng.randint(800, 1600) if long_prompt else
                                                rng.randint(4, 40), rng.randint(5, 60))))
        batch = sched.schedule()
        if not batch.seqs:
            continue
        cost = synthetic(batch.num_tokens, batch.kv_tokens, len(batch.seqs))
        assert batch.predicted_s == pytest.approx(cost, rel=1e-3)
        if len(batch.seqs) > 1 or batch.num_new_tokens[0] > 1:
            assert cost <= target_ms / 1000 * 1.0001, (step, batch.num_new_tokens)
        chunks += [n for n in batch.num_new_tokens if n > 1]
        simulate_step(sched, batch)
    assert all(r.finished for r in reqs), "the cap must not starve anything"
    assert max(chunks) < 2048  # chunks were cut below the token budget by time
    sched.bm.check_all_free()


def test_the_plan_keeps_a_margin_for_the_models_recent_error():
    model = fitted_model()
    assert model.margin == 1.0  # no errors seen yet
    for i in range(100):  # steps ran 0-30 % over their predictions
        model.observe_error(0.010 * (1 + 0.3 * (i % 10) / 9), 0.010)
    assert 1.25 < model.margin <= 1.3
    sched = make_scheduler(num_blocks=4000, block_size=16, target_itl_ms=40.0,
                           max_num_batched_tokens=2048, enable_prefix_caching=False)
    sched.cost_model = model
    for _ in range(6):
        add(sched, make_request(20, 50))
    simulate_step(sched, sched.schedule())
    add(sched, make_request(1500, 5))
    batch = sched.schedule()
    assert batch.predicted_s <= 0.040 / model.margin * 1.0001
    assert batch.predicted_s > 0.040 / model.margin * 0.9  # and uses what it may


def test_an_unchunked_prompt_over_the_target_still_runs_alone():
    sched = make_scheduler(num_blocks=4000, block_size=16, target_itl_ms=40.0,
                           enable_chunked_prefill=False, max_num_batched_tokens=4096)
    sched.cost_model = fitted_model()
    req = add(sched, make_request(2000, 3))  # its prefill alone is predicted at ~0.25 s
    for _ in range(10):
        if not sched.has_work():
            break
        simulate_step(sched, sched.schedule())
    assert req.finished


def test_a_deferred_decode_is_not_overtaken_by_new_arrivals():
    # Decodes over 3,000 tokens of context cost ~6.4 ms each; 19 ms leaves room for two
    # after the 4 ms per step, and the ~2 ms left would fit a short newcomer's prefill.
    sched = make_scheduler(num_blocks=4000, block_size=16, max_num_batched_tokens=2048,
                           enable_prefix_caching=False)
    sched.cost_model = fitted_model()
    old = [add(sched, make_request(3000, 2000)) for _ in range(3)]
    while any(r.sequences[0].num_computed_tokens < 3000 for r in old):  # prefill, uncapped
        simulate_step(sched, sched.schedule())
    sched.config.target_itl_ms = 19.0
    add(sched, make_request(8, 5))
    batch = sched.schedule()
    placed = {s.request.request_id for s in batch.seqs}
    assert not any(r.finished for r in old)
    assert len(placed) == 2, placed  # the third old decode waits ...
    assert placed <= {r.request_id for r in old}, placed  # ... and so does the newcomer


def test_without_a_target_the_same_workload_breaks_the_target():
    sched = make_scheduler(num_blocks=4000, block_size=16, max_num_batched_tokens=2048,
                           enable_prefix_caching=False)
    sched.cost_model = fitted_model()
    for _ in range(8):
        add(sched, make_request(20, 50))
    simulate_step(sched, sched.schedule())
    add(sched, make_request(1500, 5))
    batch = sched.schedule()
    assert synthetic(batch.num_tokens, batch.kv_tokens, len(batch.seqs)) > 0.040


# --- metrics -------------------------------------------------------------------------------
def test_step_duration_metrics_actual_and_predicted(tiny_llama):
    proc = ServerProcess(str(tiny_llama), host="127.0.0.33",
                         extra=["--served-model-name", "tiny", "--target-itl-ms", "200"])
    try:
        for i in range(3):
            body = (b'{"model": "tiny", "prompt": "hello %d", "max_tokens": 12, '
                    b'"ignore_eos": true}' % i)
            urllib.request.urlopen(urllib.request.Request(
                proc.url + "/v1/completions", data=body,
                headers={"Content-Type": "application/json"}), timeout=60).read()
        metrics = scrape(proc.url)
        actual = metrics['llmserve:step_duration_seconds_count{kind="actual",model_name="tiny"}']
        predicted = metrics[
            'llmserve:step_duration_seconds_count{kind="predicted",model_name="tiny"}']
        assert actual >= 36 and 0 < predicted <= actual
    finally:
        assert proc.stop() == 0
