"""spec.adapters, the operator's part: the pure decision (``lora.plan``/``lora.report``),
the engine flags and mounts the builders render, the CRD's schema, and the sync's HTTP
against an engine that keeps the documented adapter API (load, unload, /v1/models)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import kopf
import pytest
import yaml
from aiohttp import web
from kopf._core.engines import posting

from llmserve.operator import lora, lora_sync
from llmserve.operator.builders import (
    MODELS_DIR,
    Owner,
    SpecError,
    children,
    desired_adapters,
)
from llmserve.operator.kube import ReadyPod
from llmserve.operator.lora import Adapter, EngineState, Failures, plan, report

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "llmdeployments.serving.llmserve.io.yaml"
SQL = Adapter("sql", "file:///a/sql", "file:///a/sql")
CHAT = Adapter("chat", "hf://org/chat", "hf://org/chat")


def owner(**spec) -> Owner:
    base = {"model": {"source": "smollm2-135m-instruct", "name": "smol"}}
    base.update(spec)
    return Owner("chat", "team-a", "uid-123", base)


def engine_container(o: Owner) -> dict:
    dep = next(c for c in children(o, 1) if c["kind"] == "Deployment"
               and c["metadata"]["name"].endswith("-engine"))
    return dep["spec"]["template"]["spec"]["containers"][0]


def engine_template(o: Owner) -> dict:
    dep = next(c for c in children(o, 1) if c["kind"] == "Deployment"
               and c["metadata"]["name"].endswith("-engine"))
    return dep["spec"]["template"]


# --- plan: what to do on one engine ------------------------------------------------
def test_plan_loads_what_is_missing_and_unloads_what_the_spec_dropped():
    actions = plan([SQL, CHAT], {"sql": SQL.path, "old": "file:///x"}, Failures(), "p", 0)
    assert actions == [lora.Action("unload", "old"), lora.Action("load", "chat", CHAT.path)]


def test_plan_is_empty_when_the_engine_already_matches():
    assert plan([SQL, CHAT], {"sql": SQL.path, "chat": CHAT.path}, Failures(), "p", 0) == []


def test_a_new_source_for_a_name_unloads_before_loading():
    moved = Adapter("sql", "file:///b/sql", "file:///b/sql")
    assert plan([moved], {"sql": SQL.path}, Failures(), "p", 0) == [
        lora.Action("unload", "sql"), lora.Action("load", "sql", moved.path)]


def test_an_empty_spec_unloads_everything():
    assert plan([], {"sql": SQL.path, "chat": CHAT.path}, Failures(), "p", 0) == [
        lora.Action("unload", "chat"), lora.Action("unload", "sql")]


def test_a_refused_load_waits_its_retry_delay_on_that_engine_only():
    failures = Failures()
    failures.record("p1", SQL, "rank 128 above --max-lora-rank 64", now=100.0)
    assert plan([SQL], {}, failures, "p1", 100.0 + lora.RETRY_FAILED_AFTER - 1) == []
    assert plan([SQL], {}, failures, "p2", 101.0) == [lora.Action("load", "sql", SQL.path)]
    assert plan([SQL], {}, failures, "p1", 100.0 + lora.RETRY_FAILED_AFTER) == [
        lora.Action("load", "sql", SQL.path)]


def test_failures_are_forgotten_with_their_pod_or_their_adapter():
    failures = Failures()
    failures.record("gone", SQL, "bad", 0)
    failures.record("here", SQL, "bad", 0)
    failures.record("here", CHAT, "bad", 0)
    failures.keep_only({"here"}, [CHAT])
    assert set(failures.refused) == {("here", "chat", CHAT.path)}
    failures.record("here", CHAT, None, 1)  # loaded since
    assert failures.refused == {}


def test_loaded_adapters_reads_the_entries_with_a_parent():
    models = {"object": "list", "data": [
        {"id": "smol", "object": "model", "root": "/models/smol", "parent": None},
        {"id": "sql", "object": "model", "root": SQL.path, "parent": "smol"}]}
    assert lora.loaded_adapters(models) == {"sql": SQL.path}
    assert lora.loaded_adapters({"data": "junk"}) == {}


# --- report: status.adapters and the Degraded message --------------------------------
def test_report_loaded_loading_and_counts():
    engines = [EngineState("p1", {"sql": SQL.path, "chat": CHAT.path}),
               EngineState("p2", {"sql": SQL.path})]
    r = report([SQL, CHAT], engines, Failures())
    by = {a["name"]: a for a in r.adapters}
    assert by["sql"] == {"name": "sql", "source": SQL.source, "state": "Loaded",
                         "loadedReplicas": 2, "replicas": 2, "ready": "2/2", "message": ""}
    assert by["chat"]["state"] == "Loading" and by["chat"]["ready"] == "1/2"
    assert r.problem is None


def test_a_refusal_fails_the_adapter_and_degrades_with_the_engines_words():
    failures = Failures()
    failures.record("p1", CHAT, "adapter was trained for another base model", 0)
    r = report([SQL, CHAT], [EngineState("p1", {"sql": SQL.path})], failures)
    chat = next(a for a in r.adapters if a["name"] == "chat")
    assert chat["state"] == "Failed" and chat["message"] == (
        "adapter was trained for another base model")
    assert r.problem == ("adapter chat (hf://org/chat): adapter was trained for another "
                         "base model")


def test_an_engine_loaded_from_another_source_does_not_count():
    r = report([SQL], [EngineState("p1", {"sql": "file:///elsewhere"})], Failures())
    assert r.adapters[0]["state"] == "Loading" and r.adapters[0]["loadedReplicas"] == 0


def test_no_ready_engine_or_a_silent_one_is_loading_with_a_reason():
    r = report([SQL], [], Failures())
    assert r.adapters[0]["state"] == "Loading" and "ready engine" in r.adapters[0]["message"]
    r = report([SQL], [EngineState("p1", None)], Failures())
    assert r.adapters[0]["ready"] == "0/1" and "LoRA enabled" in r.adapters[0]["message"]
    r = report([SQL], [EngineState("p1", {}, {"sql": "loading on p1: no answer in 120 s"})],
               Failures())
    assert r.adapters[0]["message"] == "loading on p1: no answer in 120 s"


# --- builders: flags, mounts, refusals --------------------------------------------
ADAPTERS = [{"name": "sql", "source": "file:///adapters/sql"},
            {"name": "chat", "source": "hf://org/chat@v2"}]


def test_adapters_turn_lora_on_but_are_never_engine_flags():
    args = engine_container(owner(adapters=ADAPTERS))["args"]
    assert "--enable-lora" in args
    assert not any("lora-modules" in a or "sql" in a for a in args)
    assert "--enable-lora" not in engine_container(owner())["args"]


def test_lora_sizes_become_flags_and_engine_lora_alone_turns_it_on():
    args = engine_container(owner(engine={"lora": {"maxLoras": 2, "maxLoraRank": 16,
                                                     "maxCpuLoras": 8}}))["args"]
    i = args.index("--enable-lora")
    assert args[i:i + 7] == ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                             "--max-cpu-loras", "8"]
    assert "--enable-lora" in engine_container(owner(engine={"lora": {}}))["args"]


def test_editing_the_adapter_list_leaves_the_pod_template_alone():
    """The point of loading through the API: no rollout for an adapter added, removed
    or moved (hf://, file://, or a pvc:// on a claim already mounted)."""
    base = engine_template(owner(adapters=ADAPTERS))
    for edited in (ADAPTERS[:1], ADAPTERS + [{"name": "x", "source": "hf://o/x"}],
                   [{"name": "sql", "source": "file:///elsewhere"}]):
        assert engine_template(owner(adapters=edited)) == base


def test_pvc_adapters_mount_their_claim_read_only():
    o = owner(model={"source": "pvc://models/llama", "name": "llama"},
              adapters=[{"name": "a", "source": "pvc://models/loras/a"},
                        {"name": "b", "source": "pvc://team-loras/b"},
                        {"name": "c", "source": "pvc://team-loras/c"}])
    template = engine_template(o)
    claims = {v["persistentVolumeClaim"]["claimName"]: v for v in template["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    assert set(claims) == {"models", "team-loras"}  # one volume per claim
    assert claims["team-loras"]["persistentVolumeClaim"]["readOnly"] is True
    mounts = {m["name"]: m for m in template["spec"]["containers"][0]["volumeMounts"]}
    lora_mount = mounts[claims["team-loras"]["name"]]
    assert lora_mount == {"name": claims["team-loras"]["name"], "readOnly": True,
                          "mountPath": "/adapters/team-loras"}
    paths = {a.name: a.path for a in desired_adapters(o)}
    assert paths == {"a": f"{MODELS_DIR}/loras/a", "b": "/adapters/team-loras/b",
                     "c": "/adapters/team-loras/c"}


def test_vllm_gets_runtime_loading_and_paths_it_understands():
    o = owner(engine={"kind": "vllm"},
              adapters=[{"name": "a", "source": "hf://org/a"},
                        {"name": "b", "source": "file:///data/b"}])
    c = engine_container(o)
    assert "--enable-lora" in c["args"]
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in c["env"]
    assert {a.name: a.path for a in desired_adapters(o)} == {"a": "org/a", "b": "/data/b"}
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in str(engine_container(owner())["env"])


@pytest.mark.parametrize("spec,message", [
    ({"engine": {"args": ["--lora-modules", "x=/y"]}, "adapters": ADAPTERS},
     "--lora-modules in engine.args"),
    ({"engine": {"lora": {}, "args": ["--max-loras=8"]}}, "--max-loras in engine.args"),
    ({"adapters": [{"name": "smol", "source": "hf://o/r"}]}, "base model's served name"),
    ({"adapters": [{"name": "a", "source": "hf://o/r"}, {"name": "a", "source": "hf://o/s"}]},
     "listed twice"),
    ({"adapters": [{"name": "a", "source": "s3://b/k"}]}, "a source is hf://"),
    ({"engine": {"kind": "vllm"}, "adapters": [{"name": "a", "source": "hf://o/r@v1"}]},
     "without a revision"),
    ({"adapters": ADAPTERS, "prefill": {}}, "with spec.prefill is not supported"),
])
def test_specs_the_engines_could_not_serve_are_refused(spec, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        children(owner(**spec), 1)


def test_engine_flags_in_args_are_the_users_when_the_operator_does_not_manage_lora():
    args = engine_container(owner(engine={"args": ["--enable-lora", "--lora-modules",
                                                   "x=/y"]}))["args"]
    assert args[-3:] == ["--enable-lora", "--lora-modules", "x=/y"]


def test_api_key_comes_from_the_engines_args():
    assert lora.api_key({"engine": {"args": ["--api-key", "k1"]}}) == "k1"
    assert lora.api_key({"engine": {"args": ["--api-key=k2"]}}) == "k2"
    assert lora.api_key({}) is None


# --- the CRD --------------------------------------------
def crd_spec() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]


def test_crd_declares_adapters_lora_sizes_and_their_status():
    props = crd_spec()
    adapters = props["spec"]["properties"]["adapters"]
    assert adapters["x-kubernetes-list-map-keys"] == ["name"]  # unique names
    assert adapters["items"]["required"] == ["name", "source"]
    assert set(props["spec"]["properties"]["engine"]["properties"]["lora"]["properties"]) == {
        "maxLoras", "maxLoraRank", "maxCpuLoras"}
    item = props["status"]["properties"]["adapters"]["items"]["properties"]
    assert item["state"]["enum"] == ["Loaded", "Loading", "Failed"]


@pytest.mark.parametrize("source,ok", [
    ("hf://org/repo", True), ("hf://org/repo@abc123", True), ("pvc://claim/dir/a", True),
    ("file:///data/a", True), ("hf://repo-without-org", False), ("file://relative", False),
    ("s3://bucket/key", False), ("pvc://Upper/a", False), ("/plain/path", False)])
def test_crd_source_pattern(source, ok):
    item = crd_spec()["spec"]["properties"]["adapters"]["items"]["properties"]
    assert bool(re.fullmatch(item["source"]["pattern"], source)) is ok


# --- the sync against an engine keeping the documented API --------------------------
BASE = "smol"


def contract_engine(loaded: dict[str, str], calls: list) -> web.Application:
    """The engine's adapter API as documented: idempotent load of the same name and
    source, 400 (OpenAI's error shape) for a bad adapter or a name loaded from another
    source, 404 model_not_found for unloading what is not loaded."""
    def error(status, message, code):
        return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                            "param": None, "code": code}}, status=status)

    async def models(request):
        calls.append(("models", request.headers.get("Authorization")))
        return web.json_response({"object": "list", "data": [
            {"id": BASE, "object": "model", "root": "/models/smol", "parent": None},
            *({"id": n, "object": "model", "root": r, "parent": BASE}
              for n, r in loaded.items())]})

    async def load(request):
        body = await request.json()
        name, path = body["lora_name"], body["lora_path"]
        calls.append(("load", name))
        if "missing" in path:
            return error(400, f"adapter {path} does not exist", "invalid_adapter")
        if loaded.get(name, path) != path:
            return error(400, f"{name} is loaded from {loaded[name]}", "adapter_conflict")
        loaded[name] = path
        return web.json_response({"status": "ok"})

    async def unload(request):
        name = (await request.json())["lora_name"]
        calls.append(("unload", name))
        if loaded.pop(name, None) is None:
            return error(404, f"{name} is not loaded", "model_not_found")
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)
    return app


BODY = {"apiVersion": "serving.llmserve.io/v1alpha1", "kind": "LLMDeployment",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "uid-123"}}


async def run_sync(loaded, desired, failures, args=("--enable-lora",), api_key=None):
    """One engine's pass; (its state, the engine's calls, the events posted)."""
    import aiohttp
    calls: list = []
    runner = web.AppRunner(contract_engine(loaded, calls))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    events: asyncio.Queue = asyncio.Queue()
    posting.event_queue_loop_var.set(asyncio.get_running_loop())
    posting.event_queue_var.set(events)
    posting.settings_var.set(kopf.OperatorSettings())
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(headers=headers) as session:
            pod = ReadyPod("pod-uid", "chat-engine-0", "127.0.0.1", tuple(args))
            e = lora_sync.Engine(session, BODY, pod, f"http://127.0.0.1:{port}")
            state = await lora_sync.sync_engine(e, desired, failures)
    finally:
        await runner.cleanup()
    posted = [events.get_nowait() for _ in range(events.qsize())]
    return state, calls, [(ev.reason, ev.message) for ev in posted]


def test_sync_loads_unloads_and_reports_on_a_live_engine():
    loaded = {"old": "file:///x"}
    state, calls, events = asyncio.run(run_sync(loaded, [SQL, CHAT], Failures(),
                                                api_key="k"))
    assert loaded == {"sql": SQL.path, "chat": CHAT.path} == state.loaded
    assert ("unload", "old") in calls and calls[0] == ("models", "Bearer k")
    assert events == [("AdaptersUnloaded", "chat-engine-0: unloaded old (no longer in "
                                           "spec.adapters or moved)"),
                      ("AdaptersLoaded", "chat-engine-0: loaded sql, chat")]
    assert report([SQL, CHAT], [state], Failures()).adapters[0]["state"] == "Loaded"


def test_a_refused_load_is_remembered_with_the_engines_message():
    bad = Adapter("bad", "file:///missing/a", "file:///missing/a")
    failures = Failures()
    state, calls, events = asyncio.run(run_sync({}, [SQL, bad], failures))
    assert state.loaded == {"sql": SQL.path}
    r = report([SQL, bad], [state], failures)
    assert r.problem == "adapter bad (file:///missing/a): adapter file:///missing/a does not exist"
    assert ("AdapterLoadFailed", "adapter bad (file:///missing/a) on chat-engine-0: "
            "adapter file:///missing/a does not exist") in events
    # The next pass does not ask again within the retry delay, and still reports it.
    state, calls, _ = asyncio.run(run_sync({"sql": SQL.path}, [SQL, bad], failures))
    assert calls == [("models", None)]
    assert report([SQL, bad], [state], failures).problem == r.problem


def test_a_moved_adapter_is_unloaded_then_loaded_from_its_new_source():
    moved = Adapter("sql", "file:///b/sql", "file:///b/sql")
    loaded = {"sql": SQL.path}
    state, calls, _ = asyncio.run(run_sync(loaded, [moved], Failures()))
    assert loaded == {"sql": moved.path} and calls[1:] == [("unload", "sql"), ("load", "sql")]


def test_a_pod_without_lora_enabled_is_not_asked():
    state, calls, _ = asyncio.run(run_sync({}, [SQL], Failures(), args=("--port", "8000")))
    assert state.loaded is None and calls == []


def test_an_engine_that_does_not_answer_is_waited_for():
    async def main():
        import aiohttp
        async with aiohttp.ClientSession() as session:
            pod = ReadyPod("u", "p", "127.0.0.1", ("--enable-lora",))
            e = lora_sync.Engine(session, BODY, pod, "http://127.0.0.1:9")  # nothing there
            return await lora_sync.sync_engine(e, [SQL], Failures())
    assert asyncio.run(main()).loaded is None


def test_error_messages_of_both_shapes():
    assert lora_sync.error_message('{"error": {"message": "rank 128 > 64"}}') == "rank 128 > 64"
    assert lora_sync.error_message('{"object": "error", "message": "vllm says"}') == "vllm says"
    assert lora_sync.error_message("plain text") == "plain text"
