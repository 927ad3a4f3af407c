"""Desired state: an LLMDeployment -> the manifests of its children.

Pure functions of the resource (no API calls), so they are unit tested directly and
applying them twice changes nothing. Every child carries an owner reference to the
LLMDeployment, so deleting it garbage-collects them; a child the spec no longer
calls for (``stale_children``) is pruned by the operator.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

from llmserve import envs
from llmserve.distributed.shapes import check_tensor_parallel
from llmserve.operator import lora, prefill, speculative
from llmserve.operator.observability import tracing_args

BUILTIN_MODELS = {"smollm2-135m-instruct"}
# The shapes tensor parallelism depends on, of the models whose shape the operator knows
# without reading a checkpoint (tests check them against the converted config).
BUILTIN_SHAPES = {"smollm2-135m-instruct": {"num_attention_heads": 9, "num_key_value_heads": 3,
                                            "intermediate_size": 1536}}
DEFAULT_IMAGE = envs.LLMSERVE_IMAGE
DEFAULT_GPU_IMAGE = envs.LLMSERVE_GPU_IMAGE
DEFAULT_VLLM_IMAGE = envs.LLMSERVE_VLLM_IMAGE
OPERATOR_LABELS = {"app.kubernetes.io/name": "llmserve-operator"}
MANAGED_BY = {"app.kubernetes.io/managed-by": "llmserve-operator"}
GATEWAY_PORT = 8080
MODELS_DIR = "/models"
ADAPTERS_DIR = "/adapters"  # pvc:// adapters on claims other than the model's
DRAFT_DIR = "/draft-model"  # a pvc:// draft model on a claim not mounted otherwise
TENANTS_DIR = "/etc/llmserve/tenants"
TENANTS_KEY = "tenants.yaml"


class SpecError(ValueError):
    """The spec cannot be realised; the message goes into the Degraded condition."""


@dataclass
class Owner:
    name: str
    namespace: str
    uid: str
    spec: dict
    generation: int = 1

    @property
    def ref(self) -> dict:
        return {"apiVersion": "serving.llmserve.io/v1alpha1", "kind": "LLMDeployment",
                "name": self.name, "uid": self.uid, "controller": True,
                "blockOwnerDeletion": True}

    @property
    def model_name(self) -> str:
        return self.spec.get("model", {}).get("name") or self.name


def names(owner: Owner) -> dict[str, str]:
    n = owner.name
    return {"engine": f"{n}-engine", "gateway": f"{n}-gateway",
            "gateway_sa": f"{n}-gateway", "netpol": f"{n}-engine",
            "gateway_peers": f"{n}-gateway-peers", "prefill": f"{n}-prefill",
            "prefill_netpol": f"{n}-prefill", "kv_secret": f"{n}-kv-transfer"}


def labels(owner: Owner, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": f"llmserve-{component}",
            "app.kubernetes.io/instance": owner.name,
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/part-of": "llmserve",
            "serving.llmserve.io/deployment": owner.name, **MANAGED_BY}


def selector(owner: Owner, component: str) -> dict[str, str]:
    return {"serving.llmserve.io/deployment": owner.name,
            "app.kubernetes.io/component": component}


def selector_string(owner: Owner, component: str = "engine") -> str:
    return ",".join(f"{k}={v}" for k, v in selector(owner, component).items())


def meta(owner: Owner, name: str, component: str) -> dict:
    return {"name": name, "namespace": owner.namespace, "labels": labels(owner, component),
            "ownerReferences": [owner.ref]}


def endpoint_url(owner: Owner) -> str:
    port = owner.spec.get("gateway", {}).get("port", 80)
    return f"http://{names(owner)['gateway']}.{owner.namespace}.svc:{port}"


# --- security --------------------------------------------
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                "fsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "privileged": False, "capabilities": {"drop": ["ALL"]}}


# --- model source --------------------------------------------
def model_source(owner: Owner) -> tuple[str, list[dict], list[dict]]:
    """(value for --model, extra volumes, extra volume mounts) for the source URI."""
    source = owner.spec["model"]["source"]
    kind = owner.spec.get("engine", {}).get("kind", "llmserve")
    if source.startswith("hf://"):
        # llmserve takes the URI itself; vLLM takes the repo id and --revision.
        return source if kind == "llmserve" else source[len("hf://"):].split("@")[0], [], []
    if source.startswith("pvc://"):
        claim, _, path = source[len("pvc://"):].partition("/")
        if not claim:
            raise SpecError(f"model.source {source!r}: pvc:// needs a claim name")
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim,
                                                              "readOnly": True}}
        mount = {"name": "model", "mountPath": MODELS_DIR, "readOnly": True}
        return f"{MODELS_DIR}/{path}".rstrip("/"), [volume], [mount]
    if source.startswith("file:///"):
        return source[len("file://"):], [], []
    if "://" in source:
        raise SpecError(f"model.source {source!r}: unsupported scheme")
    if kind == "llmserve" and source not in BUILTIN_MODELS:
        raise SpecError(f"model.source {source!r} is not a built-in model "
                        f"(built-in: {', '.join(sorted(BUILTIN_MODELS))}); use hf://, "
                        f"pvc:// or file:///")
    return source, [], []


def hf_revision(owner: Owner) -> str | None:
    """The @REVISION of an hf:// source, if it names one."""
    source = owner.spec["model"]["source"]
    if not source.startswith("hf://") or "@" not in source:
        return None
    return source.split("@", 1)[1] or None


# --- LoRA adapters (spec.adapters) --------------------------------------------
def model_claim(owner: Owner) -> str | None:
    """The claim a pvc:// model source is mounted from (at MODELS_DIR)."""
    source = owner.spec["model"]["source"]
    return source[len("pvc://"):].partition("/")[0] if source.startswith("pvc://") else None


def adapter_claims(owner: Owner) -> list[str]:
    """The claims of pvc:// adapters that need a mount of their own (not the model's)."""
    sources = [a.get("source") or "" for a in owner.spec.get("adapters") or []]
    claims = {s[len("pvc://"):].partition("/")[0] for s in sources if s.startswith("pvc://")}
    return sorted(claims - {model_claim(owner), ""})


def adapter_volumes(owner: Owner) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts): each claim of a pvc:// adapter, read-only, at
    ADAPTERS_DIR/CLAIM. A new claim changes the pod template (pods restart); an adapter
    on a claim already mounted, or from hf:// or file://, does not."""
    volumes, mounts = [], []
    for claim in adapter_claims(owner):
        # Volume names are DNS labels; claim names may be longer or dotted.
        name = "lora-" + hashlib.sha256(claim.encode()).hexdigest()[:12]
        volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim,
                                                                 "readOnly": True}})
        mounts.append({"name": name, "mountPath": f"{ADAPTERS_DIR}/{claim}", "readOnly": True})
    return volumes, mounts


def adapter_path(owner: Owner, name: str, source: str) -> str:
    """What the engine is sent as ``lora_path`` for ``source``: llmserve resolves hf://
    and file:// itself; vLLM takes a repo id or a path; a pvc:// source becomes the
    path where its claim is mounted (the model's claim at MODELS_DIR, another at
    ADAPTERS_DIR/CLAIM)."""
    vllm = owner.spec.get("engine", {}).get("kind", "llmserve") == "vllm"
    where = f"adapters[{name}].source {source!r}"
    if source.startswith("hf://"):
        if not vllm:
            return source
        repo, _, revision = source[len("hf://"):].partition("@")
        if revision:
            raise SpecError(f"{where}: vLLM loads an adapter by repo id only, without a "
                            f"revision; drop @{revision} or use engine.kind llmserve")
        return repo
    if source.startswith("file:///"):
        return source[len("file://"):] if vllm else source
    if source.startswith("pvc://"):
        claim, _, path = source[len("pvc://"):].partition("/")
        if not claim:
            raise SpecError(f"{where}: pvc:// needs a claim name")
        root = MODELS_DIR if claim == model_claim(owner) else f"{ADAPTERS_DIR}/{claim}"
        return f"{root}/{path}".rstrip("/")
    raise SpecError(f"{where}: a source is hf://ORG/REPO[@REVISION], pvc://CLAIM/PATH "
                    f"or file:///PATH")


def desired_adapters(owner: Owner) -> list[lora.Adapter]:
    """spec.adapters, checked for what the API server cannot check."""
    out, seen = [], set()
    for item in owner.spec.get("adapters") or []:
        name, source = item.get("name") or "", item.get("source") or ""
        if not name:
            raise SpecError("every entry of spec.adapters needs a name")
        if name in seen:
            raise SpecError(f"spec.adapters: the name {name!r} is listed twice")
        if name == owner.model_name:
            raise SpecError(f"spec.adapters: {name!r} is the base model's served name; "
                            f"clients pick the base model or an adapter by name, so "
                            f"name the adapter differently")
        seen.add(name)
        out.append(lora.Adapter(name, source, adapter_path(owner, name, source)))
    return out


# --- speculative decoding (spec.engine.speculative) ------------------------------------
def draft_model(owner: Owner) -> tuple[dict[str, str], list[dict], list[dict]]:
    """(the draft model's keys of --speculative-config, extra volumes, extra mounts).
    Its source takes the forms of model.source: llmserve resolves a built-in name and
    hf:// itself (same cache and HF_TOKEN as the main model); vLLM takes a repo id and
    ``revision``; a pvc:// draft is read where its claim is mounted (the model's claim
    at MODELS_DIR, an adapters' claim at ADAPTERS_DIR/CLAIM, another one read-only at
    DRAFT_DIR)."""
    source = (speculative.settings(owner.spec) or {}).get("model")
    if not source:
        return {}, [], []
    vllm = owner.spec.get("engine", {}).get("kind", "llmserve") == "vllm"
    where = f"engine.speculative.model {source!r}"
    if source.startswith("hf://"):
        if not vllm:
            return {"model": source}, [], []
        repo, _, revision = source[len("hf://"):].partition("@")
        return {"model": repo, **({"revision": revision} if revision else {})}, [], []
    if source.startswith("file:///"):
        return {"model": source[len("file://"):]}, [], []
    if source.startswith("pvc://"):
        return draft_on_claim(owner, source, where)
    if "://" in source:
        raise SpecError(f"{where}: unsupported scheme; a draft model is a built-in name, "
                        f"hf://ORG/REPO[@REVISION], pvc://CLAIM/PATH or file:///PATH")
    if not vllm and source not in BUILTIN_MODELS:
        raise SpecError(f"{where} is not a built-in model (built-in: "
                        f"{', '.join(sorted(BUILTIN_MODELS))}); use hf://, pvc:// or file:///")
    return {"model": source}, [], []


def draft_on_claim(owner: Owner, source: str, where: str
                   ) -> tuple[dict[str, str], list[dict], list[dict]]:
    claim, _, path = source[len("pvc://"):].partition("/")
    if not claim:
        raise SpecError(f"{where}: pvc:// needs a claim name")
    if claim == model_claim(owner):
        return {"model": f"{MODELS_DIR}/{path}".rstrip("/")}, [], []
    if claim in adapter_claims(owner):
        return {"model": f"{ADAPTERS_DIR}/{claim}/{path}".rstrip("/")}, [], []
    volume = {"name": "draft-model", "persistentVolumeClaim": {"claimName": claim,
                                                                "readOnly": True}}
    mount = {"name": "draft-model", "mountPath": DRAFT_DIR, "readOnly": True}
    return {"model": f"{DRAFT_DIR}/{path}".rstrip("/")}, [volume], [mount]


def speculative_args(owner: Owner, tp: int, role: str) -> list[str]:
    """``--speculative-config JSON`` from spec.engine.speculative (none when unset);
    a spec the engines would refuse at start-up is refused here, saying what works."""
    conf = speculative.settings(owner.spec)
    if conf is None:
        return []
    problem = speculative.refusal(owner.spec, tp, role)
    if problem:
        raise SpecError(problem)
    draft, _, _ = draft_model(owner)
    return [speculative.FLAG, speculative.config_json(conf, draft)]


# Where the engine container keeps what it downloads (huggingface_hub's cache, Triton's
# kernel cache): the writable `cache` volume, since the root filesystem is read-only.
CACHE_DIR = "/cache"
HF_HOME = f"{CACHE_DIR}/huggingface"


def engine_env(owner: Owner) -> list[dict]:
    env = [{"name": "HOME", "value": CACHE_DIR}, {"name": "HF_HOME", "value": HF_HOME}]
    secret = owner.spec["model"].get("hfTokenSecret")
    if secret:
        if not secret.get("name"):
            raise SpecError("model.hfTokenSecret needs the name of a Secret")
        # Both engines (and huggingface_hub under them) read HF_TOKEN. A missing Secret or
        # key keeps the pod from starting (CreateContainerConfigError), which is visible.
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": secret["name"], "key": secret.get("key") or "token"}}})
    return env


# --- engine --------------------------------------------
TP_FLAGS = ("--tensor-parallel-size", "-tp")


def tensor_parallel_size(owner: Owner) -> int:
    """One rank per GPU: ``engine.tensorParallelSize`` when given, else
    ``resources.gpus``. Refuses what the spec alone shows cannot work; a model whose
    shape the operator does not know is checked by the engine at start-up, which
    exits with the message (the pod's log; the Deployment does not become ready)."""
    engine = owner.spec.get("engine", {})
    gpus = owner.spec.get("resources", {}).get("gpus", 0) or 0
    tp = engine.get("tensorParallelSize")
    if any(a == f or a.startswith(f + "=") for a in engine.get("args", []) for f in TP_FLAGS):
        raise SpecError("set engine.tensorParallelSize (or resources.gpus), not "
                        "--tensor-parallel-size in engine.args")
    if tp is None:
        return max(1, gpus)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise SpecError(f"engine.tensorParallelSize must be an integer >= 1, got {tp!r}")
    if gpus and tp != gpus:
        raise SpecError(f"engine.tensorParallelSize {tp} must equal resources.gpus {gpus}: "
                        f"each rank runs on one GPU of the pod")
    if not gpus and tp > 1 and engine.get("kind", "llmserve") == "vllm":
        raise SpecError("engine.tensorParallelSize > 1 with kind vllm needs resources.gpus")
    return tp


def check_known_shape(owner: Owner, tp: int) -> None:
    """The built-in model's heads are known: refuse a size that cannot split them."""
    shape = BUILTIN_SHAPES.get(owner.spec["model"]["source"])
    if shape is None or tp == 1:
        return
    try:
        check_tensor_parallel(SimpleNamespace(**shape), tp, owner.spec["model"]["source"])
    except ValueError as e:
        raise SpecError(f"{e} (from resources.gpus / engine.tensorParallelSize)") from e


# spec.engine keys each engine kind takes as a flag of the same meaning.
LLMSERVE_FLAGS = {"maxNumSeqs": "--max-num-seqs", "maxNumBatchedTokens":
                  "--max-num-batched-tokens", "maxModelLen": "--max-model-len",
                  "kvCacheMemory": "--kv-cache-memory", "targetITLMs": "--target-itl-ms",
                  "maxWaiting": "--max-waiting", "maxQueueDelaySeconds": "--max-queue-delay"}
VLLM_FLAGS = {"maxNumSeqs": "--max-num-seqs", "maxNumBatchedTokens":
              "--max-num-batched-tokens", "maxModelLen": "--max-model-len"}


def engine_container(owner: Owner, role: str = "both") -> dict:
    """The engine container of one pool; ``role`` is its P/D role (``prefill``,
    ``decode``, or ``both`` without a prefill pool)."""
    refuse_owned_flags(owner)
    desired_adapters(owner)  # a spec the engines could not load is refused up front
    model, _, model_mounts = model_source(owner)
    mounts = [*model_mounts, *adapter_volumes(owner)[1], *draft_model(owner)[2]]
    tp = tensor_parallel_size(owner)
    launch = llmserve_launch if engine_kind(owner) == "llmserve" else vllm_launch
    image, command, args = launch(owner, model, tp)
    args += feature_args(owner, tp, role)
    gpus = owner.spec.get("resources", {}).get("gpus", 0)
    port = owner.spec.get("engine", {}).get("port", 8000)
    probe = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        "name": "engine", "image": image, "command": command, "args": args,
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"},
                  *prefill.role_ports(role)],
        # The image bakes the built-in model's converted cache (LLMSERVE_CACHE);
        # anything downloaded at run time (hf:// snapshots) goes to the /cache volume.
        "env": engine_container_env(owner, role),
        "resources": resources(owner.spec.get("resources", {})),
        "readinessProbe": {**probe, "periodSeconds": 2, "failureThreshold": 2},
        "startupProbe": {**probe, "periodSeconds": 2, "failureThreshold": 900},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": [{"name": "cache", "mountPath": CACHE_DIR},
                         {"name": "tmp", "mountPath": "/tmp"}, *mounts,
                         *([{"name": "dshm", "mountPath": "/dev/shm"}] if gpus else [])],
    }


def engine_kind(owner: Owner) -> str:
    return owner.spec.get("engine", {}).get("kind", "llmserve")


def refuse_owned_flags(owner: Owner) -> None:
    """engine.args may not set the flags the operator derives from the spec itself."""
    args = owner.spec.get("engine", {}).get("args", [])
    flag = prefill.owned_flag_in(args)
    if flag:
        raise SpecError(f"{flag} in engine.args: the operator sets the P/D flags from "
                        f"spec.prefill (add spec.prefill for a prefill pool)")
    flag = lora.owned_flag_in(args) if lora.enabled(owner.spec) else None
    if flag:
        raise SpecError(f"{flag} in engine.args: with spec.adapters or engine.lora the "
                        f"operator sets the LoRA flags and loads the adapters itself "
                        f"(list them in spec.adapters, sizes in engine.lora)")


def llmserve_launch(owner: Owner, model: str, tp: int) -> tuple[str, list[str], list[str]]:
    """(image, command, args) of llmserve's OpenAI server, before the features' flags."""
    engine = owner.spec.get("engine", {})
    check_known_shape(owner, tp)
    gpus = owner.spec.get("resources", {}).get("gpus", 0)
    image = engine.get("image") or (DEFAULT_GPU_IMAGE if gpus else DEFAULT_IMAGE)
    args = ["--model", model, "--served-model-name", owner.model_name,
            "--host", "0.0.0.0", "--port", str(engine.get("port", 8000)),
            "--dtype", engine.get("dtype", "auto")]
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp)]
    return image, ["llmserve", "serve"], args + spec_flag_args(engine, LLMSERVE_FLAGS)


def vllm_launch(owner: Owner, model: str, tp: int) -> tuple[str, list[str], list[str]]:
    """(image, command, args) of the vLLM OpenAI server, with arguments equivalent to
    llmserve's; a setting vLLM has no equivalent of is refused, not dropped."""
    engine = owner.spec.get("engine", {})
    refuse_llmserve_only_settings(engine)
    image = engine.get("image") or DEFAULT_VLLM_IMAGE
    args = ["--served-model-name", owner.model_name, "--host", "0.0.0.0",
            "--port", str(engine.get("port", 8000)), "--dtype", engine.get("dtype", "auto")]
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp)]
    revision = hf_revision(owner)
    if revision:  # the tokenizer from the same commit as the weights
        args += ["--revision", revision, "--tokenizer-revision", revision]
    return image, ["vllm", "serve", model], args + spec_flag_args(engine, VLLM_FLAGS)


def refuse_llmserve_only_settings(engine: dict) -> None:
    if engine.get("targetITLMs") is not None:
        raise SpecError("engine.targetITLMs needs engine.kind llmserve (vLLM has no "
                        "step-latency cap)")
    for key in ("maxWaiting", "maxQueueDelaySeconds"):
        if engine.get(key) is not None:
            # Silently dropping an overload bound would leave the queue unbounded.
            raise SpecError(f"engine.{key} needs engine.kind llmserve (vLLM's waiting "
                            f"queue has no bound; bound the gateway's instead)")


def spec_flag_args(engine: dict, flags: dict[str, str]) -> list[str]:
    """``flag value`` for each of ``flags``' spec.engine keys that is set."""
    args = []
    for key, flag in flags.items():
        if engine.get(key) is not None:
            args += [flag, str(engine[key])]
    return args


def feature_args(owner: Owner, tp: int, role: str) -> list[str]:
    """The flags the spec's features add to either engine kind, then engine.args."""
    args = []
    if tenants_secret(owner):
        # Classes reach the engine as request priorities; vLLM refuses a nonzero
        # priority unless it schedules by priority, and ours ignores it under fcfs.
        args += ["--scheduling-policy", "priority"]
    if owner.spec.get("resources", {}).get("gpus", 0) and engine_kind(owner) == "llmserve":
        # A node whose runtime hides the GPU must not quietly serve on its CPU: with
        # --device cuda the engine refuses to start without CUDA.
        args += ["--device", "cuda"]
    args += prefill.role_args(role)
    args += lora.engine_args(owner.spec)
    args += speculative_args(owner, tp, role)
    args += tracing_args(owner.spec)
    return args + list(owner.spec.get("engine", {}).get("args", []))


def engine_container_env(owner: Owner, role: str) -> list[dict]:
    vllm_lora = engine_kind(owner) == "vllm" and lora.enabled(owner.spec)
    return (engine_env(owner) + prefill.role_env(role, names(owner)["kv_secret"])
            + ([lora.VLLM_RUNTIME_ENV] if vllm_lora else []))


def resources(res: dict) -> dict:
    requests, limits = {}, {}
    for key in ("cpu", "memory"):
        if res.get(key) is not None:
            requests[key] = limits[key] = str(res[key])
    if res.get("gpus"):
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(res["gpus"])
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


GPU_RESOURCE = "nvidia.com/gpu"
# GPU node pools are commonly tainted with the resource's name (GKE and AKS do it for
# every GPU pool, and NVIDIA's GPU operator documents it): a GPU pod tolerates it.
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
# NCCL moves tensor-parallel traffic through /dev/shm; the container runtime's default
# is 64 MiB, where NCCL fails or hangs. Memory-backed, counted against the pod's memory.
DEFAULT_SHM_SIZE = "2Gi"


def shared_memory_volume(res: dict) -> dict:
    return {"name": "dshm",
            "emptyDir": {"medium": "Memory", "sizeLimit": str(res.get("shmSize") or
                                                              DEFAULT_SHM_SIZE)}}


def pool_component(role: str) -> str:
    """The component label (and name suffix) of a pool: the prefill pool is its own;
    the decode pool keeps the engine's, so everything that finds engines (the scale
    subresource's selector, monitors, the gateway's --k8s-service) finds it."""
    return "prefill" if role == "prefill" else "engine"


KV_SECRET_ANNOTATION = "serving.llmserve.io/kv-transfer-secret"


def engine_deployment(owner: Owner, replicas: int, role: str = "both",
                      kv_secret: str | None = None) -> dict:
    """The Deployment of one engine pool; the prefill pool's is built from
    ``prefill_owner(owner)``. ``kv_secret``: the fingerprint of the P/D Secret's value
    (``prefill.secret_fingerprint``), on the pod template so a new value rolls the pods."""
    spec = owner.spec
    component = pool_component(role)
    template_meta = {"labels": labels(owner, component)}
    if kv_secret and role != "both":
        template_meta["annotations"] = {KV_SECRET_ANNOTATION: kv_secret}
    _, volumes, _ = model_source(owner)
    volumes = [*volumes, *adapter_volumes(owner)[0], *draft_model(owner)[1]]
    res = spec.get("resources", {})
    pod_spec = {
        "securityContext": POD_SECURITY,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "containers": [engine_container(owner, role)],
        "volumes": [{"name": "cache", "emptyDir": {}},
                    {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "256Mi"}},
                    *volumes],
    }
    if res.get("nodeSelector"):
        pod_spec["nodeSelector"] = dict(res["nodeSelector"])
    tolerations = list(res.get("tolerations") or [])
    if res.get("gpus"):
        pod_spec["volumes"].append(shared_memory_volume(res))
        if not any(t.get("key") == GPU_RESOURCE for t in tolerations):
            tolerations.append(GPU_TOLERATION)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if res.get("runtimeClassName"):  # e.g. "nvidia" where it is not the node's default
        pod_spec["runtimeClassName"] = res["runtimeClassName"]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": meta(owner, names(owner)[component], component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(owner, component)},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": template_meta, "spec": pod_spec},
        },
    }


def engine_service(owner: Owner, role: str = "both") -> dict:
    """Headless: the gateway reads its EndpointSlices and talks to pods directly."""
    port = owner.spec.get("engine", {}).get("port", 8000)
    component = pool_component(role)
    kv = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]}
          for p in prefill.role_ports(role)]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": meta(owner, names(owner)[component], component),
            "spec": {"clusterIP": "None", "selector": selector(owner, component),
                     "publishNotReadyAddresses": False,
                     "ports": [{"name": "http", "port": port, "targetPort": "http"}, *kv]}}


# --- prefill pool (spec.prefill) --------------------------------------------
def prefill_owner(owner: Owner) -> Owner:
    """``owner`` as the prefill pool sees it: spec.prefill's engine and resources over
    the main pool's. Refuses, with what would work, what the engines would refuse at
    start-up (``EngineConfig._check_kv_transfer``), so it shows as Degraded rather
    than as pods that never become ready."""
    refusal = prefill.refusal(owner.spec)
    if refusal:
        raise SpecError(refusal)
    if lora.enabled(owner.spec):
        raise SpecError("spec.adapters (or engine.lora) with spec.prefill is not supported "
                        "yet: the prefill pool would need every adapter too, and the KV it "
                        "hands over is computed with the request's adapter; remove "
                        "spec.prefill to serve adapters")
    pool = replace(owner, spec=prefill.prefill_pool_spec(owner.spec))
    for name, o in (("decode", owner), ("prefill", pool)):
        tp = tensor_parallel_size(o)
        if tp > 1:
            raise SpecError(f"spec.prefill: the {name} pool would run tensor-parallel size "
                            f"{tp} (resources.gpus / engine.tensorParallelSize), and a P/D "
                            f"role runs on one rank for now (each rank would hold a shard "
                            f"of the KV): give each pool's engines one GPU, or remove "
                            f"spec.prefill")
    if prefill.NO_PREFIX_CACHING in owner.spec.get("engine", {}).get("args", []):
        raise SpecError(f"spec.prefill: the decode pool needs prefix caching (the KV it "
                        f"reads from prefill engines enters it): remove "
                        f"{prefill.NO_PREFIX_CACHING} from engine.args")
    return pool


def prefill_children(owner: Owner, replicas: int, kv_secret: str | None = None) -> list[dict]:
    """The prefill pool: its Service, Deployment and NetworkPolicy."""
    pool = prefill_owner(owner)
    return [engine_service(pool, "prefill"),
            engine_deployment(pool, replicas, "prefill", kv_secret),
            prefill_network_policy(owner)]


def kv_transfer_secret(owner: Owner, value: str) -> dict:
    """The shared secret of the deployment's side channel. Created once with a random
    value (never applied, so reconciling never rotates it) and immutable; owned by the
    LLMDeployment, so it goes with it."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "immutable": True,
            "metadata": meta(owner, names(owner)["kv_secret"], "kv-transfer"),
            "stringData": {prefill.KV_SECRET_KEY: value}}


# --- gateway --------------------------------------------
def gateway_deployment(owner: Owner) -> dict:
    gw = owner.spec.get("gateway", {})
    n = names(owner)
    files = gateway_secret_files(owner)
    args = [*gateway_routing_args(owner), *tracing_args(owner.spec), *files.args,
            *max_in_flight_args(owner)]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": meta(owner, n["gateway"], "gateway"),
        "spec": {
            "replicas": gw.get("replicas", 1),
            "selector": {"matchLabels": selector(owner, "gateway")},
            "template": {"metadata": {"labels": labels(owner, "gateway")}, "spec": {
                "serviceAccountName": n["gateway_sa"],
                "securityContext": POD_SECURITY, "enableServiceLinks": False,
                "containers": [gateway_container(gw, args, files)],
                "volumes": [{"name": "tmp", "emptyDir": {"medium": "Memory",
                                                          "sizeLimit": "64Mi"}},
                            *files.volumes]}},
        },
    }


def gateway_routing_args(owner: Owner) -> list[str]:
    """Where the engines (and the prefill pool) are, and how the gateway picks one."""
    gw = owner.spec.get("gateway", {})
    n = names(owner)
    args = ["--k8s-service", f"{owner.namespace}/{n['engine']}", "--k8s-port-name", "http",
            "--host", "0.0.0.0", "--port", str(GATEWAY_PORT),
            "--policy", gw.get("policy", "prefix-hash"),
            "--load-factor", str(gw.get("loadFactor", 1.25)),
            "--prefix-chars", str(gw.get("prefixChars", 100))]
    if prefill.has_prefill(owner.spec):  # long prompts go through both pools
        args += ["--prefill-k8s-service", f"{owner.namespace}/{n['prefill']}"]
    return args


@dataclass
class SecretFiles:
    """Files the gateway reads from Secrets: their volumes and mounts, and the flags
    and environment that point it at them."""
    args: list[str] = field(default_factory=list)
    volumes: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)
    env: list[dict] = field(default_factory=list)

    def add(self, volume: str, secret: str, key: str, mount_path: str) -> None:
        self.volumes.append({"name": volume, "secret": {"secretName": secret,
                                                         "items": [{"key": key, "path": key}]}})
        self.mounts.append({"name": volume, "mountPath": mount_path, "readOnly": True})


def gateway_secret_files(owner: Owner) -> SecretFiles:
    """The API keys file, or the tenants file (whose tenants hold the API keys, and
    whose limits the replicas share through their peers)."""
    files = SecretFiles()
    api_keys = owner.spec.get("gateway", {}).get("apiKeySecret")
    if api_keys:
        key = api_keys.get("key", "api-keys")
        files.add("api-keys", api_keys["name"], key, "/etc/llmserve/keys")
        files.args += ["--api-key-file", f"/etc/llmserve/keys/{key}"]
    tenants = tenants_secret(owner)
    if tenants:
        if api_keys:
            raise SpecError("gateway.apiKeySecret and gateway.tenantsSecret are exclusive: "
                            "with tenants, API keys are in the tenants file")
        name, key = tenants
        files.add("tenants", name, key, TENANTS_DIR)
        files.args += ["--tenants", f"{TENANTS_DIR}/{key}",
                       "--peer-service", f"{owner.namespace}/{names(owner)['gateway_peers']}"]
        # Peers are found by address; this pod's own is left out.
        files.env.append({"name": "POD_IP",
                          "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    return files


def max_in_flight_args(owner: Owner) -> list[str]:
    max_in_flight = owner.spec.get("gateway", {}).get("maxInFlightPerEngine")
    if max_in_flight is None and tenants_secret(owner):
        # The class queues only hold requests back if engines have a bound; by default,
        # the batch an engine can run at once.
        max_in_flight = owner.spec.get("engine", {}).get("maxNumSeqs", 128)
    return ["--max-in-flight", str(max_in_flight)] if max_in_flight else []


def gateway_container(gw: dict, args: list[str], files: SecretFiles) -> dict:
    probe = {"httpGet": {"path": "/metrics", "port": "http"}}
    return {
        "name": "gateway", "image": gw.get("image") or DEFAULT_IMAGE,
        "command": ["llmserve", "gateway"], "args": args,
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
        "readinessProbe": {**probe, "periodSeconds": 2},
        "livenessProbe": {**probe, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                      "limits": {"memory": "512Mi"}},
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *files.mounts],
        **({"env": files.env} if files.env else {}),
    }


def gateway_service(owner: Owner) -> dict:
    gw = owner.spec.get("gateway", {})
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": meta(owner, names(owner)["gateway"], "gateway"),
            "spec": {"type": gw.get("serviceType", "ClusterIP"),
                     "selector": selector(owner, "gateway"),
                     "ports": [{"name": "http", "port": gw.get("port", 80),
                                "targetPort": "http"}]}}


def tenants_secret(owner: Owner) -> tuple[str, str] | None:
    """(Secret name, key) of the tenants file, if the deployment has tenants."""
    ref = owner.spec.get("gateway", {}).get("tenantsSecret")
    if not ref:
        return None
    if not ref.get("name"):
        raise SpecError("gateway.tenantsSecret needs the name of a Secret")
    return ref["name"], ref.get("key") or TENANTS_KEY


def gateway_peers_service(owner: Owner) -> dict:
    """Headless: gateway replicas find each other through it to share tenants' limits."""
    n = names(owner)
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": meta(owner, n["gateway_peers"], "gateway"),
            "spec": {"clusterIP": "None", "selector": selector(owner, "gateway"),
                     "publishNotReadyAddresses": False,
                     "ports": [{"name": "http", "port": GATEWAY_PORT, "targetPort": "http"}]}}


def gateway_rbac(owner: Owner) -> list[dict]:
    """The gateway may read EndpointSlices in its namespace, nothing else."""
    n = names(owner)["gateway_sa"]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(owner, n, "gateway")},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": meta(owner, n, "gateway"),
         "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": meta(owner, n, "gateway"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": n},
         "subjects": [{"kind": "ServiceAccount", "name": n, "namespace": owner.namespace}]},
    ]


def http_ingress(owner: Owner) -> dict:
    """This deployment's gateway (and the operator, which scrapes metrics) reach an
    engine's HTTP port."""
    port = owner.spec.get("engine", {}).get("port", 8000)
    return {"from": [{"podSelector": {"matchLabels": selector(owner, "gateway")}},
                     {"namespaceSelector": {}, "podSelector": {"matchLabels":
                                                               OPERATOR_LABELS}}],
            "ports": [{"protocol": "TCP", "port": port}]}


def peer_ingress(owner: Owner, from_component: str) -> dict:
    """KV transfer between this deployment's two pools, on every port: the decode
    engine opens the prefill engine's side channel (5600), and with the NIXL backend
    (the default where it loads) UCX moves the blocks over connections on ports of its
    own choosing, in both directions (its wireup answers back over TCP; RDMA bypasses
    the policy). No other pod gains anything: the side channel serves only peers that
    hold the deployment's secret."""
    return {"from": [{"podSelector": {"matchLabels": selector(owner, from_component)}}]}


def network_policy(owner: Owner) -> dict:
    """Only this deployment's gateway (and the operator) may reach the engines; beside a
    prefill pool, its engines too (``peer_ingress``)."""
    ingress = [http_ingress(owner)]
    if prefill.has_prefill(owner.spec):
        ingress.append(peer_ingress(owner, "prefill"))
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": meta(owner, names(owner)["netpol"], "engine"),
            "spec": {"podSelector": {"matchLabels": selector(owner, "engine")},
                     "policyTypes": ["Ingress"], "ingress": ingress}}


def prefill_network_policy(owner: Owner) -> dict:
    """The prefill pool: the gateway and the operator on HTTP, the decode pool for
    KV transfer."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": meta(owner, names(owner)["prefill_netpol"], "prefill"),
            "spec": {"podSelector": {"matchLabels": selector(owner, "prefill")},
                     "policyTypes": ["Ingress"],
                     "ingress": [http_ingress(owner), peer_ingress(owner, "engine")]}}


def children(owner: Owner, engine_replicas: int, prefill_replicas: int = 1,
             kv_secret: str | None = None) -> list[dict]:
    """Every child, in the order they are applied (the prefill pool before the
    gateway that is pointed at it). The kv-transfer Secret is not among them: it is
    created once (``kv_transfer_secret``), never applied; ``kv_secret`` is its value's
    fingerprint, once it exists."""
    role = prefill.role_of_main_pool(owner.spec)
    pool = (prefill_children(owner, prefill_replicas, kv_secret)
            if prefill.has_prefill(owner.spec) else [])
    return [*gateway_rbac(owner), engine_service(owner, role),
            engine_deployment(owner, engine_replicas, role, kv_secret), network_policy(owner),
            *pool,
            gateway_deployment(owner), gateway_service(owner),
            *([gateway_peers_service(owner)] if tenants_secret(owner) else [])]


# --- pruning --------------------------------------------
def children_selector(owner: Owner) -> str:
    """The labels every child of ``owner`` carries: what the operator lists to prune."""
    return ",".join(f"{k}={v}" for k, v in
                    {"serving.llmserve.io/deployment": owner.name, **MANAGED_BY}.items())


def named_children(owner: Owner) -> list[tuple[str, str]]:
    """(kind, name) of the children that are read back by name to prune, not listed
    (the operator may not list Secrets): whether or not the spec still calls for them."""
    return [("Secret", names(owner)["kv_secret"])]


def is_own_child(owner: Owner, obj: dict) -> bool:
    """Ours to delete: controlled by this very LLMDeployment (its uid, so not a
    same-named predecessor) and labelled as its child by this operator."""
    m = obj["metadata"]
    controlled = any(r.get("uid") == owner.uid and r.get("kind") == "LLMDeployment"
                     and r.get("controller") for r in m.get("ownerReferences") or [])
    obj_labels = m.get("labels") or {}
    return (controlled and m.get("namespace") == owner.namespace
            and obj_labels.get("serving.llmserve.io/deployment") == owner.name
            and all(obj_labels.get(k) == v for k, v in MANAGED_BY.items()))


def stale_children(owner: Owner, desired: list[dict], live: list[dict]) -> list[dict]:
    """The live objects to delete: our own children (``is_own_child``) whose kind and
    name the desired state no longer has. Anything else, even same-named or labelled
    alike, is left alone, as are objects already being deleted."""
    wanted = {(m["kind"], m["metadata"]["name"]) for m in desired}
    return [obj for obj in live
            if (obj["kind"], obj["metadata"]["name"]) not in wanted
            and not obj["metadata"].get("deletionTimestamp")
            and is_own_child(owner, obj)]
