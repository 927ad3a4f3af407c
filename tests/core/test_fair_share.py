"""The virtual token counters that both the gateway's and the engine's queues order
tenants by (``core/sched/fair_share.py``)."""

from __future__ import annotations

import subprocess
import sys

from llmserve.core.sched.fair_share import VirtualTokenCounters


def test_the_gateway_imports_the_rule_without_torch():
    # The gateway runs without torch; the shared rule must not pull it in.
    code = ("import sys, llmserve.gateway.fairness, llmserve.core.sched.fair_share; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_tokens_are_charged_by_weight_and_the_least_served_goes_next():
    vtc = VirtualTokenCounters()
    vtc.charge("heavy", 100, weight=1)
    vtc.charge("light", 100, weight=4)
    assert vtc.counters == {"heavy": 100.0, "light": 25.0}
    assert vtc.fairest(["heavy", "light"], tenant_of=str) == "light"
    vtc.charge("light", -100, weight=4)  # an estimate corrected downwards
    assert vtc.virtual("light") == 0.0
    assert vtc.virtual("never-seen") == 0.0


def test_on_a_tie_the_first_given_goes_next():
    vtc = VirtualTokenCounters()
    heads = [("b", 1), ("a", 2)]  # oldest first
    assert vtc.fairest(heads, tenant_of=lambda head: head[0]) == ("b", 1)


def test_a_tenant_back_from_idle_is_lifted_to_the_least_busy_counter():
    vtc = VirtualTokenCounters()
    vtc.charge("x", 50, weight=1)
    vtc.charge("y", 80, weight=1)
    vtc.catch_up("idle", busy=["x", "y"])
    assert vtc.virtual("idle") == 50.0
    vtc.charge("ahead", 500, weight=1)
    vtc.catch_up("ahead", busy=["x", "y"])  # never lowered
    assert vtc.virtual("ahead") == 500.0


def test_with_no_tenant_busy_the_last_served_is_the_floor():
    vtc = VirtualTokenCounters()
    vtc.charge("x", 30, weight=1)
    vtc.served("x")
    vtc.catch_up("back", busy=[])
    assert vtc.virtual("back") == 30.0
