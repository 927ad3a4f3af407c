"""Multi-LoRA, the operator's part: keeping every ready engine's adapters equal to
``spec.adapters``.

Adapters are loaded through the engine's API (``POST /v1/load_lora_adapter``), never
as ``--lora-modules``, so editing the list never restarts a pod. Each pass reads what
an engine has (``GET /v1/models``: adapters are the entries with a ``parent``, their
``root`` the path they were loaded from) and diffs it against the spec, so the
operator keeps no state that matters: restarted, it converges to the same engines.

This module is the pure part, unit tested like ``autoscaler.decide``: the spec's
flags (``engine_args``), what to do on one engine (``plan``), and the status and
Degraded message that follow from what every engine answered (``report``). A load
that the engine refused is retried only after ``RETRY_FAILED_AFTER`` seconds (a bad
hf:// source is not fetched again every tick); ``Failures`` remembers those refusals,
which is memory only (a restarted operator tries once more, then knows again).
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENABLE_FLAG = "--enable-lora"
# spec.engine.lora's fields and the flags they become (llmserve's and vLLM's names).
SIZE_FLAGS = {"maxLoras": "--max-loras", "maxLoraRank": "--max-lora-rank",
              "maxCpuLoras": "--max-cpu-loras"}
# Flags the operator owns once it manages adapters; --lora-modules would load adapters
# the spec does not list, which the operator would then unload.
OWNED_FLAGS = (ENABLE_FLAG, "--lora-modules", *SIZE_FLAGS.values())
SCHEMES = ("hf://", "pvc://", "file:///")
# vLLM refuses /v1/load_lora_adapter unless this is set.
VLLM_RUNTIME_ENV = {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"}
RETRY_FAILED_AFTER = 60.0  # seconds before a refused load is tried again on that engine

LOADED, LOADING, FAILED = "Loaded", "Loading", "Failed"


def enabled(spec: dict) -> bool:
    """LoRA is on with any adapter listed, or with ``engine.lora`` (even empty: engines
    that keep LoRA on with no adapter, so adding the first one restarts nothing)."""
    return bool(spec.get("adapters")) or spec.get("engine", {}).get("lora") is not None


def engine_args(spec: dict) -> list[str]:
    """The LoRA flags of an engine (none when LoRA is off); unset sizes are the
    engine's defaults."""
    if not enabled(spec):
        return []
    sizes = spec.get("engine", {}).get("lora") or {}
    args = [ENABLE_FLAG]
    for key, flag in SIZE_FLAGS.items():
        if sizes.get(key) is not None:
            args += [flag, str(sizes[key])]
    return args


def owned_flag_in(args: list[str]) -> str | None:
    for a in args:
        for flag in OWNED_FLAGS:
            if a == flag or a.startswith(flag + "="):
                return flag
    return None


def api_key(spec: dict) -> str | None:
    """The engines' Bearer key, where engine.args gives them one (``--api-key``)."""
    args = list(spec.get("engine", {}).get("args", []))
    for i, a in enumerate(args):
        if a == "--api-key" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--api-key="):
            return a.split("=", 1)[1]
    return None


@dataclass(frozen=True)
class Adapter:
    """One adapter of the spec: ``source`` as the user wrote it (for the status),
    ``path`` as the engine is sent it, and reports it back as ``root``."""
    name: str
    source: str
    path: str


@dataclass(frozen=True)
class Action:
    kind: str  # "load" or "unload"
    name: str
    path: str = ""


@dataclass
class Failures:
    """Refused loads: (pod uid, adapter name, path) -> (the engine's message, when)."""
    refused: dict[tuple[str, str, str], tuple[str, float]] = field(default_factory=dict)

    def holding(self, pod: str, a: Adapter, now: float) -> bool:
        entry = self.refused.get((pod, a.name, a.path))
        return entry is not None and now - entry[1] < RETRY_FAILED_AFTER

    def message(self, pod: str, a: Adapter) -> str | None:
        entry = self.refused.get((pod, a.name, a.path))
        return None if entry is None else entry[0]

    def record(self, pod: str, a: Adapter, message: str | None, now: float) -> None:
        """A load's outcome: refused with ``message``, or loaded (None)."""
        if message is None:
            self.refused.pop((pod, a.name, a.path), None)
        else:
            self.refused[(pod, a.name, a.path)] = (message, now)

    def keep_only(self, pods: set[str], adapters: list[Adapter]) -> None:
        """Forget refusals of pods that are gone and of adapters no longer in the spec
        (an adapter put back is tried at once)."""
        wanted = {(a.name, a.path) for a in adapters}
        self.refused = {k: v for k, v in self.refused.items()
                        if k[0] in pods and (k[1], k[2]) in wanted}


def loaded_adapters(models: dict) -> dict[str, str]:
    """name -> root of the adapters in a ``GET /v1/models`` answer (the base model has
    no parent)."""
    return {m["id"]: str(m.get("root") or "") for m in models.get("data", [])
            if isinstance(m, dict) and m.get("parent") and m.get("id")}


def plan(desired: list[Adapter], loaded: dict[str, str], failures: Failures, pod: str,
         now: float) -> list[Action]:
    """What to do on one engine: unload what the spec no longer lists or now names from
    another source (the engine refuses a name loaded from another source), then load
    what is missing, except a refused load still within its retry delay."""
    wanted = {a.name: a for a in desired}
    unloads = [name for name, root in sorted(loaded.items())
               if name not in wanted or root != wanted[name].path]
    loads = [a for a in desired if (a.name not in loaded or a.name in unloads)
             and not failures.holding(pod, a, now)]
    return ([Action("unload", n) for n in unloads]
            + [Action("load", a.name, a.path) for a in loads])


@dataclass
class EngineState:
    """One engine after its actions: the adapters it holds (None: it did not answer,
    or LoRA is not on in that pod yet), and why a load is still pending (a timeout,
    a 5xx), by adapter name."""
    pod: str
    loaded: dict[str, str] | None
    pending: dict[str, str] = field(default_factory=dict)


@dataclass
class Report:
    adapters: list[dict]  # status.adapters
    problem: str | None  # the Degraded message, None when every adapter is fine


def report(desired: list[Adapter], engines: list[EngineState], failures: Failures
           ) -> Report:
    """Each adapter's status over the ready engines (``engines``), and the Degraded
    message: every refusal, with the engine's own words."""
    out, problems = [], []
    for a in desired:
        holding = [e for e in engines if e.loaded is not None and e.loaded.get(a.name) == a.path]
        refusals = sorted({m for e in engines if (m := failures.message(e.pod, a))})
        total = len(engines)
        if refusals:
            state, message = FAILED, "; ".join(refusals)
            problems.append(f"adapter {a.name} ({a.source}): {message}")
        elif total and len(holding) == total:
            state, message = LOADED, ""
        else:
            state, message = LOADING, waiting_reason(a, engines)
        out.append({"name": a.name, "source": a.source, "state": state,
                    "loadedReplicas": len(holding), "replicas": total,
                    "ready": f"{len(holding)}/{total}", "message": message})
    return Report(out, "; ".join(problems) or None)


def waiting_reason(a: Adapter, engines: list[EngineState]) -> str:
    if not engines:
        return "waiting for a ready engine"
    pending = sorted({e.pending[a.name] for e in engines if a.name in e.pending})
    if pending:
        return "; ".join(pending)
    if any(e.loaded is None for e in engines):
        return "waiting for engines to answer with LoRA enabled"
    return ""
