"""Desired-state builders, pruning, the autoscaler decision table (pure functions) and
the scrape that feeds it."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from llmserve.operator.autoscaler import Decision, History, Observation, Policy, decide
from llmserve.operator.builders import (
    Owner,
    SpecError,
    children,
    children_selector,
    endpoint_url,
    model_source,
    stale_children,
)
from llmserve.operator.handlers import scrape
from llmserve.operator.kube import CHILD_KINDS


def owner(**spec) -> Owner:
    base = {"model": {"source": "smollm2-135m-instruct", "name": "smol"}}
    base.update(spec)
    return Owner("chat", "team-a", "uid-123", base)


def by_kind(objs):
    out = {}
    for o in objs:
        out.setdefault(o["kind"], []).append(o)
    return out


def test_every_child_is_owned_and_labelled():
    objs = children(owner(), 2)
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["Deployment", "Deployment", "NetworkPolicy", "Role", "RoleBinding",
                     "Service", "Service", "ServiceAccount"]
    for o in objs:
        ref = o["metadata"]["ownerReferences"][0]
        assert ref == {"apiVersion": "serving.llmserve.io/v1alpha1", "kind": "LLMDeployment",
                       "name": "chat", "uid": "uid-123", "controller": True,
                       "blockOwnerDeletion": True}
        assert o["metadata"]["namespace"] == "team-a"
        assert o["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "llmserve-operator"


def test_engine_deployment_runs_llmserve_with_the_spec():
    spec = {"engine": {"maxNumSeqs": 32, "args": ["--block-size", "32"]},
            "resources": {"cpu": "2", "memory": "4Gi", "nodeSelector": {"pool": "cpu"},
                          "tolerations": [{"key": "k", "operator": "Exists"}]}}
    dep = by_kind(children(owner(**spec), 3))["Deployment"][0]
    assert dep["metadata"]["name"] == "chat-engine" and dep["spec"]["replicas"] == 3
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["llmserve", "serve"]
    args = c["args"]
    assert args[args.index("--model") + 1] == "smollm2-135m-instruct"
    assert args[args.index("--served-model-name") + 1] == "smol"
    assert args[args.index("--max-num-seqs") + 1] == "32"
    assert args[-2:] == ["--block-size", "32"]
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"},
                              "limits": {"cpu": "2", "memory": "4Gi"}}
    assert pod["nodeSelector"] == {"pool": "cpu"} and pod["tolerations"][0]["key"] == "k"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    template_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert template_labels | dep["spec"]["selector"]["matchLabels"] == template_labels


def test_target_itl_reaches_the_engine_and_is_refused_for_vllm():
    dep = by_kind(children(owner(engine={"targetITLMs": 120}), 1))["Deployment"][0]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--target-itl-ms") + 1] == "120"
    with pytest.raises(SpecError, match="targetITLMs"):
        children(owner(engine={"kind": "vllm", "targetITLMs": 120}), 1)


def test_overload_bounds_reach_the_engine_and_are_refused_for_vllm():
    import argparse

    from llmserve.entrypoints.cli import add_engine_args, engine_config
    dep = by_kind(children(owner(engine={"maxWaiting": 32, "maxQueueDelaySeconds": 2.5}),
                           1))["Deployment"][0]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-waiting") + 1] == "32"
    assert args[args.index("--max-queue-delay") + 1] == "2.5"
    parser = argparse.ArgumentParser()  # what `llmserve serve` makes of them
    add_engine_args(parser)
    parsed, _ = parser.parse_known_args([*args, "--device", "cpu"])
    config = engine_config(parsed)
    assert (config.max_waiting, config.max_queue_delay) == (32, 2.5)
    for key in ("maxWaiting", "maxQueueDelaySeconds"):
        with pytest.raises(SpecError, match=key):
            children(owner(engine={"kind": "vllm", key: 4}), 1)


def test_security_context_everywhere():
    for dep in by_kind(children(owner(), 1))["Deployment"]:
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
        mounts = {m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"]}
        assert "/tmp" in mounts  # writable scratch on a read-only root


def test_gpu_vllm_variant():
    o = owner(model={"source": "hf://Qwen/Qwen2.5-7B-Instruct@main", "name": "qwen"},
              engine={"kind": "vllm", "maxModelLen": 8192}, resources={"gpus": 2})
    c = by_kind(children(o, 1))["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["vllm", "serve", "Qwen/Qwen2.5-7B-Instruct"]
    assert "--tensor-parallel-size" in c["args"] and "--max-model-len" in c["args"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert "vllm" in c["image"]


def test_model_sources():
    assert model_source(owner(model={"source": "file:///data/m"}))[0] == "/data/m"
    src, vols, mounts = model_source(owner(model={"source": "pvc://models/llama/3b"}))
    assert src == "/models/llama/3b"
    assert vols[0]["persistentVolumeClaim"]["claimName"] == "models"
    assert mounts[0]["readOnly"] is True
    assert model_source(owner(model={"source": "hf://a/b"}))[0] == "hf://a/b"
    with pytest.raises(SpecError, match="not a built-in model"):
        model_source(owner(model={"source": "gpt-5"}))
    with pytest.raises(SpecError):
        model_source(owner(model={"source": "s3://bucket/x"}))


def engine_pod(o: Owner) -> dict:
    return by_kind(children(o, 1))["Deployment"][0]["spec"]["template"]["spec"]


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("kind", ["llmserve", "vllm"])
def test_hf_token_secret_becomes_hf_token(kind):
    o = owner(model={"source": "hf://meta-llama/Llama-3.2-1B-Instruct", "name": "llama",
                     "hfTokenSecret": {"name": "hf"}}, engine={"kind": kind})
    env = env_of(engine_pod(o)["containers"][0])
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    o.spec["model"]["hfTokenSecret"] = {"name": "creds", "key": "hf-token"}
    env = env_of(engine_pod(o)["containers"][0])
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "creds", "key": "hf-token"}}
    # no secret, no HF_TOKEN (and never a literal token in the pod spec)
    del o.spec["model"]["hfTokenSecret"]
    assert "HF_TOKEN" not in env_of(engine_pod(o)["containers"][0])


def test_hf_token_secret_needs_a_name():
    o = owner(model={"source": "hf://a/b", "hfTokenSecret": {"key": "token"}})
    with pytest.raises(SpecError, match="hfTokenSecret needs the name of a Secret"):
        children(o, 1)


@pytest.mark.parametrize("kind", ["llmserve", "vllm"])
def test_hf_cache_is_on_a_writable_volume(kind):
    """The root filesystem is read-only: HF_HOME (and HOME) must be on a mounted volume
    that is not the read-only model volume."""
    pod = engine_pod(owner(model={"source": "hf://a/b"}, engine={"kind": kind}))
    c = pod["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    env = env_of(c)
    volumes = {v["name"]: v for v in pod["volumes"]}
    for var in ("HF_HOME", "HOME"):
        mount = next(m for m in c["volumeMounts"]
                     if (env[var] + "/").startswith(m["mountPath"].rstrip("/") + "/"))
        assert not mount.get("readOnly")
        assert "emptyDir" in volumes[mount["name"]]
    assert env["HF_HOME"] == "/cache/huggingface"


def test_hf_sources_per_engine_kind():
    llmserve = owner(model={"source": "hf://Qwen/Qwen2.5-0.5B-Instruct@v1.0"})
    args = engine_pod(llmserve)["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "hf://Qwen/Qwen2.5-0.5B-Instruct@v1.0"
    assert "--revision" not in args  # the loader reads @REV from the URI
    vllm = owner(model={"source": "hf://Qwen/Qwen2.5-0.5B-Instruct@v1.0"},
                 engine={"kind": "vllm"})
    c = engine_pod(vllm)["containers"][0]
    assert c["command"] == ["vllm", "serve", "Qwen/Qwen2.5-0.5B-Instruct"]
    assert c["args"][c["args"].index("--revision") + 1] == "v1.0"
    assert c["args"][c["args"].index("--tokenizer-revision") + 1] == "v1.0"
    unpinned = owner(model={"source": "hf://Qwen/Qwen2.5-0.5B-Instruct"},
                     engine={"kind": "vllm"})
    assert "--revision" not in engine_pod(unpinned)["containers"][0]["args"]


def test_crd_declares_hf_token_secret():
    from pathlib import Path

    import yaml
    crd = (Path(__file__).resolve().parents[2] / "crds"
           / "llmdeployments.serving.llmserve.io.yaml")
    schema = yaml.safe_load(crd.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    model = schema["properties"]["spec"]["properties"]["model"]
    secret = model["properties"]["hfTokenSecret"]
    assert secret["type"] == "object" and secret["required"] == ["name"]
    assert "x-kubernetes-preserve-unknown-fields" not in secret  # unknown fields are pruned
    assert set(secret["properties"]) == {"name", "key"}
    assert all(p["type"] == "string" for p in secret["properties"].values())
    assert secret["properties"]["key"]["default"] == "token"


def test_gateway_children():
    o = owner(gateway={"replicas": 2, "policy": "least-load", "serviceType": "LoadBalancer",
                       "apiKeySecret": {"name": "keys", "key": "k"}})
    objs = by_kind(children(o, 1))
    gw = objs["Deployment"][1]
    assert gw["spec"]["replicas"] == 2
    pod = gw["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "chat-gateway"
    args = pod["containers"][0]["args"]
    assert args[args.index("--k8s-service") + 1] == "team-a/chat-engine"
    assert args[args.index("--policy") + 1] == "least-load"
    assert args[args.index("--api-key-file") + 1] == "/etc/llmserve/keys/k"
    assert pod["volumes"][-1]["secret"]["secretName"] == "keys"
    svc = [s for s in objs["Service"] if s["metadata"]["name"] == "chat-gateway"][0]
    assert svc["spec"]["type"] == "LoadBalancer"
    engine_svc = [s for s in objs["Service"] if s["metadata"]["name"] == "chat-engine"][0]
    assert engine_svc["spec"]["clusterIP"] == "None"
    role = objs["Role"][0]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    assert objs["RoleBinding"][0]["subjects"][0]["name"] == "chat-gateway"
    netpol = objs["NetworkPolicy"][0]["spec"]
    assert netpol["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "engine"
    assert netpol["ingress"][0]["from"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "gateway"
    assert endpoint_url(o) == "http://chat-gateway.team-a.svc:80"


def test_tenants_secret_renders_the_file_peers_and_priorities():
    o = owner(gateway={"replicas": 3, "tenantsSecret": {"name": "tenants"}},
              engine={"maxNumSeqs": 48})
    objs = by_kind(children(o, 1))
    engine, gw = objs["Deployment"]
    pod = gw["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert args[args.index("--tenants") + 1] == "/etc/llmserve/tenants/tenants.yaml"
    assert args[args.index("--peer-service") + 1] == "team-a/chat-gateway-peers"
    assert args[args.index("--max-in-flight") + 1] == "48"  # the engines' batch by default
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} \
        in container["env"]
    assert {"name": "tenants", "secret": {"secretName": "tenants", "items": [
        {"key": "tenants.yaml", "path": "tenants.yaml"}]}} in pod["volumes"]
    peers = [s for s in objs["Service"] if s["metadata"]["name"] == "chat-gateway-peers"][0]
    assert peers["spec"]["clusterIP"] == "None"
    assert peers["spec"]["selector"]["app.kubernetes.io/component"] == "gateway"
    # Classes become request priorities, which the engines must schedule by.
    engine_args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
    assert engine_args[engine_args.index("--scheduling-policy") + 1] == "priority"
    vllm = children(owner(gateway={"tenantsSecret": {"name": "t", "key": "k"}},
                          engine={"kind": "vllm"}, model={"source": "hf://org/m", "name": "m"}),
                    1)
    vllm_args = by_kind(vllm)["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    assert "--scheduling-policy" in vllm_args["args"]
    # Without tenants: no peers Service, no cap, FCFS engines, as before.
    plain = by_kind(children(owner(), 1))
    assert len(plain["Service"]) == 2
    plain_args = plain["Deployment"][1]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--max-in-flight" not in plain_args and "--tenants" not in plain_args


def test_tenants_and_api_key_secrets_are_exclusive():
    with pytest.raises(SpecError, match="exclusive"):
        children(owner(gateway={"tenantsSecret": {"name": "t"},
                                "apiKeySecret": {"name": "k"}}), 1)


# --- pruning ----------------------------------------------------------------------------------
def live(objs):
    """What the API server would list back: the applied manifests, with uids."""
    return [{**o, "metadata": {**o["metadata"], "uid": f"live-{i}"}} for i, o in enumerate(objs)]


def named(objs):
    return sorted((o["kind"], o["metadata"]["name"]) for o in objs)


TENANTED = {"gateway": {"tenantsSecret": {"name": "tenants"}}}


def test_every_kind_the_builders_render_can_be_listed_and_pruned():
    assert {o["kind"] for o in children(owner(**TENANTED), 1)} <= set(CHILD_KINDS)


def test_removing_tenants_makes_only_the_peers_service_stale():
    was = live(children(owner(**TENANTED), 1))
    now = children(owner(), 1)
    assert named(stale_children(owner(), now, was)) == [("Service", "chat-gateway-peers")]
    assert stale_children(owner(**TENANTED), children(owner(**TENANTED), 1), was) == []
    assert stale_children(owner(), now, live(now)) == []


def peers_like(**meta):
    """A Service named like the peers Service, with our labels and owner unless told."""
    peers = next(o for o in children(owner(**TENANTED), 1)
                 if o["metadata"]["name"] == "chat-gateway-peers")
    return {**peers, "metadata": {**peers["metadata"], "uid": "other", **meta}}


@pytest.mark.parametrize("why,obj", [
    ("no owner reference", peers_like(ownerReferences=[])),
    ("another LLMDeployment of the same name (a predecessor's uid)",
     peers_like(ownerReferences=[{**owner().ref, "uid": "uid-old"}])),
    ("owned, but not as its controller",
     peers_like(ownerReferences=[{**owner().ref, "controller": False}])),
    ("owned by something that is not an LLMDeployment",
     peers_like(ownerReferences=[{**owner().ref, "kind": "ConfigMap"}])),
    ("not labelled at all", peers_like(labels={})),
    ("not labelled as managed by the operator",
     peers_like(labels={"serving.llmserve.io/deployment": "chat"})),
    ("labelled for another LLMDeployment",
     peers_like(labels={**peers_like()["metadata"]["labels"],
                        "serving.llmserve.io/deployment": "other"})),
    ("in another namespace", peers_like(namespace="team-b")),
    ("already being deleted", peers_like(deletionTimestamp="2026-01-01T00:00:00Z")),
])
def test_only_our_own_labelled_children_are_pruned(why, obj):
    now = children(owner(), 1)
    assert stale_children(owner(), now, [obj]) == [], why
    assert named(stale_children(owner(), now, [peers_like()])) == \
        [("Service", "chat-gateway-peers")]  # the same object, ours: pruned


def test_children_selector_matches_every_child():
    selector = dict(kv.split("=") for kv in children_selector(owner()).split(","))
    for o in children(owner(**TENANTED), 1):
        assert selector.items() <= o["metadata"]["labels"].items(), o["metadata"]["name"]


# --- autoscaler -------------------------------------------------------------------------------
POLICY = Policy(min_replicas=1, max_replicas=6, target_queue_depth=4, target_kv_utilization=0.8,
                tolerance=0.1, scale_up_window=0, scale_down_window=60, scale_to_zero_after=0)


def obs(waiting=0.0, running=0.0, kv=0.0, ready=1) -> Observation:
    return Observation(waiting, running, kv, ready)


@pytest.mark.parametrize("current,o,want", [
    (2, obs(waiting=16, ready=2), 4),        # 8 waiting per replica vs 4: double
    (2, obs(waiting=8.4, ready=2), 2),       # ratio 1.05: inside the tolerance band
    (2, obs(kv=0.96, ready=2), 3),           # KV 0.96 / 0.8 = 1.2 -> ceil(2.4)
    (2, obs(waiting=16, kv=0.96, ready=2), 4),  # the larger ask wins
    (4, obs(waiting=200, ready=4), 6),       # clamped to maxReplicas
    (1, obs(), 1),                           # idle, never below minReplicas
])
def test_decision_table(current, o, want):
    assert decide(current, o, POLICY, History(), now=0.0).replicas == want


def test_missing_metrics_hold():
    d = decide(3, None, POLICY, History(), now=0.0)
    assert d == Decision(3, "metrics unavailable: holding")


def test_scale_down_waits_for_the_window():
    h = History()
    assert decide(4, obs(waiting=16, ready=4), POLICY, h, now=0).replicas == 4
    # load vanishes: proposals drop to 1, but the 60 s window remembers the 4
    assert decide(4, obs(ready=4), POLICY, h, now=30).replicas == 4
    assert decide(4, obs(ready=4), POLICY, h, now=59).replicas == 4
    assert decide(4, obs(ready=4), POLICY, h, now=61).replicas == 1


def test_scale_up_window_takes_the_smallest_recent_proposal():
    p = Policy(**{**POLICY.__dict__, "scale_up_window": 30})
    h = History()
    assert decide(2, obs(ready=2, running=2), p, h, now=0).replicas == 2
    assert decide(2, obs(waiting=32, ready=2), p, h, now=10).replicas == 2  # a spike waits
    assert decide(2, obs(waiting=32, ready=2), p, h, now=35).replicas == 6  # sustained


def test_scale_to_zero_after_idle_and_back():
    p = Policy(**{**POLICY.__dict__, "min_replicas": 0, "scale_to_zero_after": 120,
                  "scale_down_window": 0})
    h = History()
    assert decide(1, obs(running=1), p, h, now=0).replicas == 1
    assert decide(1, obs(), p, h, now=100).replicas == 1
    d = decide(1, obs(), p, h, now=121)
    assert d.replicas == 0 and "zero" in d.reason
    assert decide(0, None, p, h, now=200).replicas == 0
    woken = decide(0, Observation(0, 0, 0, 0, demand_at_zero=3), p, h, now=210)
    assert woken.replicas == 1


def test_zero_replicas_without_scale_to_zero_returns_to_min():
    assert decide(0, None, POLICY, History(), now=0).replicas == 1


def engine_args(o: Owner) -> list[str]:
    return by_kind(children(o, 1))["Deployment"][0]["spec"]["template"]["spec"][
        "containers"][0]["args"]


def test_tensor_parallel_size_follows_the_gpus_for_llmserve():
    args = engine_args(owner(resources={"gpus": 3}))
    assert args[args.index("--tensor-parallel-size") + 1] == "3"
    assert "--tensor-parallel-size" not in engine_args(owner(resources={"gpus": 1}))
    assert "--tensor-parallel-size" not in engine_args(owner())
    # CPU tensor parallelism is asked for explicitly.
    cpu = engine_args(owner(engine={"tensorParallelSize": 3}))
    assert cpu[cpu.index("--tensor-parallel-size") + 1] == "3"
    vllm = engine_args(owner(engine={"kind": "vllm", "tensorParallelSize": 4},
                             model={"source": "hf://Qwen/Qwen2.5-7B-Instruct", "name": "q"},
                             resources={"gpus": 4}))
    assert vllm[vllm.index("--tensor-parallel-size") + 1] == "4"


@pytest.mark.parametrize("spec, message", [
    # The built-in model's 9 query heads do not split in two: the engine would refuse
    # it at start-up; the operator knows its shape and says so as Degraded.
    ({"resources": {"gpus": 2}}, r"9 query heads are not divisible by 2.*Sizes that "
                                 r"work for it: 1, 3 "),
    ({"engine": {"tensorParallelSize": 2}, "resources": {"gpus": 4}},
     "must equal resources.gpus 4"),
    ({"engine": {"tensorParallelSize": 0}}, "integer >= 1"),
    ({"engine": {"args": ["--tensor-parallel-size", "3"]}}, "set engine.tensorParallelSize"),
    ({"engine": {"kind": "vllm", "tensorParallelSize": 2}}, "needs resources.gpus"),
])
def test_tensor_parallel_size_refused_from_the_spec(spec, message):
    with pytest.raises(SpecError, match=message):
        children(owner(**spec), 1)


def test_unknown_model_shapes_are_left_to_the_engine():
    args = engine_args(owner(model={"source": "hf://Qwen/Qwen2.5-7B-Instruct", "name": "q"},
                             resources={"gpus": 2}))
    assert args[args.index("--tensor-parallel-size") + 1] == "2"


def test_builtin_shape_matches_the_converted_checkpoint(builtin_path):
    from llmserve.model_executor.model_loader.sources import load_config
    from llmserve.operator.builders import BUILTIN_SHAPES
    config = load_config(builtin_path)
    for key, value in BUILTIN_SHAPES["smollm2-135m-instruct"].items():
        assert getattr(config, key) == value, key


# --- GPU pods (issue 27, item 4) --------------------------------------------------------
def test_a_gpu_pod_refuses_the_cpu_has_shared_memory_and_tolerates_the_gpu_taint():
    pod = engine_pod(owner(resources={"gpus": 3}))
    c = pod["containers"][0]
    assert c["args"][c["args"].index("--device") + 1] == "cuda"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    assert "runtimeClassName" not in pod


def test_gpu_pod_options_runtime_class_shm_size_and_own_tolerations():
    own = [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "a100",
            "effect": "NoSchedule"}, {"key": "spot", "operator": "Exists"}]
    pod = engine_pod(owner(resources={"gpus": 1, "runtimeClassName": "nvidia",
                                      "shmSize": "8Gi", "tolerations": own}))
    assert pod["runtimeClassName"] == "nvidia"
    assert next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"][
        "sizeLimit"] == "8Gi"
    assert pod["tolerations"] == own  # the user's own toleration for the key wins


def test_a_vllm_gpu_pod_gets_shared_memory_but_no_llmserve_flag():
    pod = engine_pod(owner(engine={"kind": "vllm"}, resources={"gpus": 2},
                           model={"source": "hf://Qwen/Qwen2.5-7B-Instruct", "name": "q"}))
    assert "--device" not in pod["containers"][0]["args"]
    assert any(v["name"] == "dshm" for v in pod["volumes"])


def test_a_cpu_pod_has_none_of_the_gpu_additions():
    pod = engine_pod(owner(resources={"cpu": "2"}))
    assert "--device" not in pod["containers"][0]["args"]
    assert not any(v["name"] == "dshm" for v in pod["volumes"])
    assert "tolerations" not in pod and "runtimeClassName" not in pod


async def test_scrape_sums_each_metric_and_gives_none_when_the_page_fails():
    page = ('vllm:num_requests_waiting{model_name="a"} 2\n'
            'vllm:num_requests_waiting{model_name="b"} 3\n')

    async def metrics(request):
        if request.path == "/broken":
            return web.Response(status=500)
        return web.Response(text=page)

    app = web.Application()
    app.router.add_get("/{tail:.*}", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as session:
            assert await scrape(session, url + "/metrics") == {"vllm:num_requests_waiting": 5.0}
            assert await scrape(session, url + "/broken") is None
    finally:
        await runner.cleanup()


# --- tracing (spec.observability, issue 34) -------------------------------------------------
def containers_by_pod(o: Owner) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
            for d in by_kind(children(o, 1, 1))["Deployment"]}


def flag_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


@pytest.mark.parametrize("kind", ["llmserve", "vllm"])
def test_otlp_endpoint_reaches_every_engine_and_the_gateway(kind):
    url = "http://otel-collector.monitoring:4318"
    spec = {"observability": {"otlpTracesEndpoint": url}, "engine": {"kind": kind}}
    if kind == "llmserve":  # a prefill pool's engines trace too (vLLM has no spec.prefill)
        spec["prefill"] = {"replicas": 1}
    pods = containers_by_pod(owner(**spec))
    assert len(pods) == (3 if kind == "llmserve" else 2)
    for name, container in pods.items():
        assert flag_value(container["args"], "--otlp-traces-endpoint") == url, name


def test_otlp_endpoint_defaults_to_the_operators_and_an_empty_one_turns_it_off(monkeypatch):
    assert all("--otlp-traces-endpoint" not in c["args"]
               for c in containers_by_pod(owner()).values())
    monkeypatch.setenv("LLMSERVE_OTLP_TRACES_ENDPOINT", "http://collector:4318")
    for container in containers_by_pod(owner()).values():
        assert flag_value(container["args"], "--otlp-traces-endpoint") == "http://collector:4318"
    off = owner(observability={"otlpTracesEndpoint": ""})
    assert all("--otlp-traces-endpoint" not in c["args"]
               for c in containers_by_pod(off).values())
    # the user's own engine.args still come last (they may override any flag)
    user = owner(engine={"args": ["--otlp-traces-endpoint", "http://mine:4318"]})
    args = containers_by_pod(user)["chat-engine"]["args"]
    assert args[-2:] == ["--otlp-traces-endpoint", "http://mine:4318"]


def test_crd_declares_the_otlp_endpoint():
    import re
    from pathlib import Path

    import yaml
    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds"
                          / "llmdeployments.serving.llmserve.io.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    field = spec["properties"]["observability"]["properties"]["otlpTracesEndpoint"]
    assert re.fullmatch(field["pattern"], "http://c:4318") and re.fullmatch(field["pattern"], "")
    assert not re.fullmatch(field["pattern"], "grpc://c:4317")
