"""A short soak (benchmarks/serving/soak.py) in CI: nothing lost among clients that stayed,
nothing leaked on any engine after clients walked away at random points."""

from __future__ import annotations

from benchmarks.serving.soak import soak
from llmserve.entrypoints.launcher import ServerProcess
from tests.gateway.test_gateway import start_gateway
from tests.server_proc import ServerProcess as EngineProcess


def test_short_soak_with_disconnects_loses_and_leaks_nothing(tiny_llama):
    engines = [EngineProcess(str(tiny_llama), host=f"127.0.0.{51 + i}",
                             extra=["--served-model-name", "tiny", "--num-threads", "1"])
               for i in range(3)]
    gateway: ServerProcess | None = None
    try:
        gateway = start_gateway(engines, host="127.0.0.50")
        result = soak(gateway, engines, n=60, disconnect_share=0.3, concurrency=12,
                      seed=5, model="tiny", warm_up=6, max_tokens=24)
    finally:
        for p in ([gateway] if gateway else []) + engines:
            p.stop()
    assert result["requests"] == 60
    assert result["failed"] == 0, result["failed_by_cause"]
    assert result["disconnected"] >= 8, "the soak really walked away from some streams"
    assert result["completed"] + result["disconnected"] == 60
    assert not result["leaked"], result["engines_after"]
    for e in result["engines_after"]:
        assert e["running"] == e["waiting"] == 0 and e["kv_usage"] == e["kv_idle"]
    assert set(result["rss_mb"]) == {"gateway", "engine0", "engine1", "engine2"}
    print("soak:", {k: result[k] for k in ("completed", "disconnected", "ttft", "itl",
                                          "rss_mb")})
