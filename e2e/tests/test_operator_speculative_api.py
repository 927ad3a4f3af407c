"""spec.engine.speculative (issue 33) against a real API server: the CRD's schema and CEL
rules accept and refuse what docs/operator.md says, a live operator renders
--speculative-config into the engine Deployment (and mounts a pvc:// draft model), and a
spec the engines could not serve goes Degraded with the reason, rolling nothing out.
Zero engine replicas: the rendered objects are the point, no engine process starts.
The pure translation and refusals are unit tested in tests/operator/test_operator_speculative.py."""

from __future__ import annotations

import json

import pytest

from e2e.tests.conftest import OperatorProcess, get_json, wait_for

NS = "spec-decode"
NGRAM = {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 4,
         "promptLookupMin": 2, "disableByBatchSize": 8}
GPU_MODEL = {"source": "hf://Qwen/Qwen2.5-7B-Instruct", "name": "q"}


@pytest.fixture(scope="module")
def namespace(kubectl, crd):
    kubectl("create", "namespace", NS)
    yield NS
    kubectl("delete", "llmd", "--all", "-n", NS, "--wait=true", "--timeout=60s", check=False)


@pytest.fixture(scope="module")
def operator(cluster, namespace):
    op = OperatorProcess(cluster, namespace).start()
    yield op
    op.stop()


def llmd(name: str, speculative: dict | None, engine: dict | None = None, **spec) -> str:
    engine = {**(engine or {}), **({"speculative": speculative} if speculative else {})}
    body = {"model": {"source": "smollm2-135m-instruct", "name": "smol"}, "replicas": 0,
            "engine": engine, **spec}
    return json.dumps({"apiVersion": "serving.llmserve.io/v1alpha1", "kind": "LLMDeployment",
                       "metadata": {"name": name, "namespace": NS}, "spec": body})


def dry_run(kubectl, body: str):
    return kubectl("apply", "--dry-run=server", "-f", "-", input=body, check=False)


@pytest.mark.parametrize("speculative", [
    NGRAM,
    {"numSpeculativeTokens": 1},
    {"numSpeculativeTokens": 16, "promptLookupMin": 3},
    {"numSpeculativeTokens": 3, "model": "hf://org/draft@v1"},  # method inferred
    {"method": "draft_model", "numSpeculativeTokens": 3, "model": "pvc://drafts/tiny"},
    {"numSpeculativeTokens": 3, "model": "smollm2-135m-instruct", "disableByBatchSize": 4},
    {"numSpeculativeTokens": 3, "model": "file:///srv/draft"},
])
def test_the_api_server_accepts_the_documented_shapes(kubectl, namespace, speculative):
    r = dry_run(kubectl, llmd("ok", speculative))
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("speculative,message", [
    ({"method": "ngram"}, "spec.engine.speculative.numSpeculativeTokens: Required value"),
    ({"numSpeculativeTokens": 0}, "should be greater than or equal to 1"),
    ({"numSpeculativeTokens": 17}, "should be less than or equal to 16"),
    ({"numSpeculativeTokens": 2, "method": "eagle"}, "Unsupported value"),
    ({"numSpeculativeTokens": 2, "promptLookupMin": 4, "promptLookupMax": 2},
     "promptLookupMin must not exceed promptLookupMax"),
    ({"numSpeculativeTokens": 2, "promptLookupMax": 0}, "should be greater than or equal to 1"),
    ({"numSpeculativeTokens": 2, "disableByBatchSize": 0},
     "should be greater than or equal to 1"),
    ({"numSpeculativeTokens": 2, "method": "draft_model"}, "method draft_model needs model"),
    ({"numSpeculativeTokens": 2, "method": "ngram", "model": "hf://o/d"},
     "which method ngram does not use"),
    ({"numSpeculativeTokens": 2, "model": "hf://o/d", "promptLookupMax": 3},
     "a draft model takes none"),
    ({"numSpeculativeTokens": 2, "model": "s3://bucket/draft"},
     "engine.speculative.model must be a built-in name or start with"),
    ({"numSpeculativeTokens": 2, "ngram": True}, 'unknown field "spec.engine.speculative.ngram"'),
])
def test_the_api_server_refuses_what_cannot_work(kubectl, namespace, speculative, message):
    r = dry_run(kubectl, llmd("bad", speculative))
    assert r.returncode != 0 and message in r.stderr, r.stderr


def engine_deployment(kubectl, name: str) -> dict | None:
    r = kubectl("get", "deployment", f"{name}-engine", "-n", NS, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def conditions(kubectl, name: str) -> dict:
    status = get_json(kubectl, "llmd", name, "-n", NS).get("status") or {}
    return {c["type"]: c for c in status.get("conditions", [])}


def speculative_config(dep: dict) -> dict:
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    return json.loads(args[args.index("--speculative-config") + 1])


def test_the_operator_renders_the_flag_into_the_engine_deployment(kubectl, operator):
    kubectl("apply", "-f", "-", input=llmd("ngram", NGRAM))
    dep = wait_for(lambda: engine_deployment(kubectl, "ngram"), 60, what="the engine Deployment")
    assert speculative_config(dep) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2, "disable_by_batch_size": 8}
    cond = wait_for(lambda: conditions(kubectl, "ngram").get("Degraded"), 60, what="conditions")
    assert cond["status"] == "False", cond
    # An edit rolls out: the template follows the spec.
    kubectl("patch", "llmd", "ngram", "-n", NS, "--type=merge", "-p",
            json.dumps({"spec": {"engine": {"speculative": {"numSpeculativeTokens": 2}}}}))
    wait_for(lambda: speculative_config(engine_deployment(kubectl, "ngram"))
             ["num_speculative_tokens"] == 2, 60, what="the edited config rendered")
    # Removed, the flag goes.
    kubectl("patch", "llmd", "ngram", "-n", NS, "--type=json",
            "-p", '[{"op": "remove", "path": "/spec/engine/speculative"}]')
    wait_for(lambda: "--speculative-config" not in engine_deployment(kubectl, "ngram")
             ["spec"]["template"]["spec"]["containers"][0]["args"], 60,
             what="the flag removed")
    kubectl("delete", "llmd", "ngram", "-n", NS)


def test_a_pvc_draft_model_is_mounted_read_only(kubectl, operator):
    kubectl("apply", "-f", "-", input=llmd(
        "draft", {"numSpeculativeTokens": 3, "model": "pvc://drafts/tiny"}))
    dep = wait_for(lambda: engine_deployment(kubectl, "draft"), 60, what="the engine Deployment")
    pod = dep["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if v.get("persistentVolumeClaim", {})
                .get("claimName") == "drafts"]
    assert volume["persistentVolumeClaim"]["readOnly"] is True
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    assert speculative_config(dep) == {"method": "draft_model", "num_speculative_tokens": 3,
                                       "model": f"{mount['mountPath']}/tiny"}
    kubectl("delete", "llmd", "draft", "-n", NS)


def test_specs_the_engines_would_refuse_are_degraded(kubectl, operator):
    cases = [
        ("in-args", llmd("in-args", NGRAM, {"args": ["--speculative-config", "{}"]}),
         "remove the flag from engine.args"),
        ("tp", llmd("tp", NGRAM, model=GPU_MODEL, resources={"gpus": 2}),
         "tensor-parallel size 2"),
        ("pd", llmd("pd", NGRAM, prefill={"replicas": 0}),
         "engine.speculative with spec.prefill is not supported yet"),
        ("async", llmd("async", NGRAM, {"args": ["--async-scheduling"]}),
         "remove --async-scheduling from engine.args"),
    ]
    for _, body, _ in cases:
        kubectl("apply", "-f", "-", input=body)
    for name, _, message in cases:
        cond = wait_for(lambda n=name: conditions(kubectl, n).get("Degraded"), 60,
                        what=f"{name} Degraded")
        assert cond["status"] == "True" and cond["reason"] == "InvalidSpec", cond
        assert message in cond["message"], cond
        assert engine_deployment(kubectl, name) is None  # nothing rolled out
        kubectl("delete", "llmd", name, "-n", NS)
    assert operator.proc.poll() is None, "the operator must not crash"
