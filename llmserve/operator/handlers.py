"""kopf handlers for LLMDeployment.

Reconciling is level-based: every pass computes the whole desired state from the
spec (``builders``), server-side-applies it and deletes the children it no longer
has (``builders.stale_children``), so it is idempotent, repairs drift, and an
operator restarted at any point converges to the same state. A
timer per LLMDeployment re-applies, scrapes the engines' /metrics, runs the
autoscaler decision (``autoscaler.decide``) and keeps the status current.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import NamedTuple

import aiohttp
import kopf
from kubernetes_asyncio import client

from llmserve.gateway.endpoints import KV_USAGE, WAITING
from llmserve.gateway.tenants import TenantsError, parse_tenants_file
from llmserve.metrics_scrape import sum_by_name
from llmserve.operator import kube, lora, lora_sync, metrics
from llmserve.operator.autoscaler import History, Observation, Policy, decide
from llmserve.operator.builders import (
    Owner,
    SpecError,
    children,
    children_selector,
    endpoint_url,
    kv_transfer_secret,
    named_children,
    names,
    selector_string,
    stale_children,
    tenants_secret,
)
from llmserve.operator.prefill import KV_SECRET_KEY, has_prefill, secret_fingerprint

GROUP, VERSION, PLURAL = "serving.llmserve.io", "v1alpha1", "llmdeployments"
RUNNING = "vllm:num_requests_running"
ADAPTER_FAILED = "AdapterLoadFailed"  # the Degraded reason when an engine refused an adapter
WAITING_PROMPT_TOKENS = "llmserve:num_waiting_prompt_tokens"
log = logging.getLogger("llmserve.operator")

_histories: dict[str, History] = {}  # uid (the main pool), uid/prefill -> autoscaler memory


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_) -> None:
    await kube.load_config()
    settings.persistence.finalizer = "serving.llmserve.io/finalizer"
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 270
    # A deletion that arrives while the object's timer is mid-tick waits for the tick
    # to end, checked every cancellation_polling seconds: kopf's default of 60 held the
    # finalizer (and `kubectl delete --wait`) for a minute whenever a tick was running.
    settings.background.cancellation_polling = 1.0


def owner_of(body) -> Owner:
    meta = body["metadata"]
    return Owner(meta["name"], meta["namespace"], meta["uid"], dict(body["spec"]),
                 meta.get("generation", 1))


def condition(type_: str, ok: bool, reason: str, message: str, generation: int) -> dict:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason,
            "message": message, "observedGeneration": generation,
            "lastTransitionTime": now_iso()}


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_conditions(old: list, new: list) -> list:
    """Keep lastTransitionTime when a condition's status did not change."""
    before = {c["type"]: c for c in old or []}
    out = []
    for c in new:
        prev = before.get(c["type"])
        if prev and prev.get("status") == c["status"]:
            c = {**c, "lastTransitionTime": prev.get("lastTransitionTime", c["lastTransitionTime"])}
        out.append(c)
    return out


async def engine_replicas(api, o: Owner, status: dict) -> int:
    """Replicas to apply: spec.replicas without autoscaling; with it, what the
    autoscaler last decided (or the live Deployment's, or minReplicas)."""
    auto = o.spec.get("autoscaling") or {}
    if not auto.get("enabled"):
        return int(o.spec.get("replicas", 1))
    if status.get("desiredReplicas") is not None:
        return int(status["desiredReplicas"])
    dep = await kube.get_deployment(api, o.namespace, names(o)["engine"])
    if dep is not None:
        return int(dep["spec"].get("replicas") or 0)
    return max(int(auto.get("minReplicas", 1)), 1)


async def prefill_replicas(api, o: Owner, status: dict) -> int:
    """The prefill pool's replicas, chosen as ``engine_replicas`` chooses the main
    pool's: spec.prefill.replicas, or with autoscaling what it last decided."""
    pool = o.spec.get("prefill") or {}
    if not (o.spec.get("autoscaling") or {}).get("enabled"):
        return int(pool.get("replicas", 1))
    desired = (status.get("prefill") or {}).get("desiredReplicas")
    if desired is not None:
        return int(desired)
    dep = await kube.get_deployment(api, o.namespace, names(o)["prefill"])
    if dep is not None:
        return int(dep["spec"].get("replicas") or 0)
    return max(int(pool.get("minReplicas", 1)), 1)


def update_prefill_status(patch, fields: dict) -> None:
    """Merge into status.prefill of this patch: the autoscaler and the reconcile of
    one tick both write parts of it."""
    patch.status["prefill"] = {**(patch.status.get("prefill") or {}), **fields}


@dataclass
class Plan:
    """What one pass applies: each pool's replicas, and the children they render to."""
    replicas: int
    prefill_replicas: int
    desired: list[dict]
    tenants_problem: str | None  # a bad tenants file the running gateways outlive


async def reconcile(body, patch, logger) -> None:
    """One pass: plan the children, apply them, read the pools back, bring the
    adapters in line, write the status."""
    o = owner_of(body)
    status = dict(body.get("status") or {})
    async with client.ApiClient() as api:
        try:
            plan = await plan_children(api, body, o, status)
        except SpecError as e:
            refuse_spec(body, patch, o, status, str(e))
            return
        await apply_children(api, body, patch, o, status, plan)
        live = await read_deployments(api, o)
    adapters = await sync_adapters(patch, o, status, body)
    write_status(patch, o, status, plan, live, adapters)


async def plan_children(api, body, o: Owner, status: dict) -> Plan:
    """The replicas and children this pass applies; SpecError when the spec cannot be
    realised."""
    replicas = await engine_replicas(api, o, status)
    # A prefill pool with no decode engine to hand KV to follows it to zero.
    prefill_n = (await prefill_replicas(api, o, status)
                 if has_prefill(o.spec) and replicas > 0 else 0)
    desired = children(o, replicas, prefill_n)
    return Plan(replicas, prefill_n, desired, await tenants_problem(api, body, o))


async def tenants_problem(api, body, o: Owner) -> str | None:
    """What is wrong with the tenants file, once gateways already run; SpecError for a
    first rollout."""
    try:
        await check_tenants(api, o)
    except SpecError as e:
        # Running gateways keep their last good file, so a bad edit must not
        # stop reconciling (scaling, drift repair); a first rollout waits.
        if await kube.get_deployment(api, o.namespace, names(o)["gateway"]) is None:
            raise
        kopf.warn(body, reason="InvalidTenants", message=str(e))
        metrics.record_reconcile_error(o.namespace, o.name, "InvalidTenants")
        return str(e)
    return None


def refuse_spec(body, patch, o: Owner, status: dict, message: str) -> None:
    """A spec that cannot be realised: Degraded, not Ready, not Progressing."""
    kopf.warn(body, reason="InvalidSpec", message=message)
    metrics.record_reconcile_error(o.namespace, o.name, "InvalidSpec")
    conditions = [condition("Degraded", True, "InvalidSpec", message, o.generation),
                  condition("Ready", False, "InvalidSpec", message, o.generation),
                  condition("Progressing", False, "InvalidSpec", message, o.generation)]
    patch.status["conditions"] = merge_conditions(status.get("conditions"), conditions)
    patch.status["observedGeneration"] = o.generation


async def apply_children(api, body, patch, o: Owner, status: dict, plan: Plan) -> None:
    """Create what is made once, then converge on the plan; a failed API call is
    Degraded and retried (kopf.TemporaryError)."""
    # A fresh random value each pass, used only when the Secret does not exist yet.
    once = [kv_transfer_secret(o, secrets.token_urlsafe(32))] if has_prefill(o.spec) else []
    desired = plan.desired
    try:
        fingerprint = await create_once(api, body, once)
        if fingerprint:  # the pods, stamped with the value they will read
            desired = children(o, plan.replicas, plan.prefill_replicas, fingerprint)
        await converge(api, body, o, desired, once)
    except ConvergeError as e:
        message = str(e)
        kopf.warn(body, reason="ApplyFailed", message=message)
        metrics.record_reconcile_error(o.namespace, o.name, "ApplyFailed")
        patch.status["conditions"] = merge_conditions(status.get("conditions"), [
            condition("Degraded", True, "ApplyFailed", message, o.generation)])
        raise kopf.TemporaryError(message, delay=10) from e


class LiveDeployments(NamedTuple):
    """The pools' Deployments as read back after applying ({} when absent)."""
    engine: dict
    gateway: dict
    prefill: dict | None  # None without spec.prefill


async def read_deployments(api, o: Owner) -> LiveDeployments:
    engine = await kube.get_deployment(api, o.namespace, names(o)["engine"]) or {}
    gateway = await kube.get_deployment(api, o.namespace, names(o)["gateway"]) or {}
    pool = (await kube.get_deployment(api, o.namespace, names(o)["prefill"]) or {}
            if has_prefill(o.spec) else None)
    return LiveDeployments(engine, gateway, pool)


def replica_count(deployment: dict, field: str) -> int:
    """status.replicas or status.readyReplicas of a Deployment read back (0 if unset)."""
    return int((deployment.get("status") or {}).get(field) or 0)


def write_status(patch, o: Owner, status: dict, plan: Plan, live: LiveDeployments,
                 adapters: lora.Report | None) -> None:
    """The status from the Deployments read back: replicas, readiness, conditions."""
    ready = replica_count(live.engine, "readyReplicas")
    gw_ready = replica_count(live.gateway, "readyReplicas")
    current = replica_count(live.engine, "replicas")
    metrics.record_replicas(o.namespace, o.name, "engine", plan.replicas, current)
    # Serving needs the main pool and a gateway; without prefill engines the decode
    # engines prefill themselves, so the prefill pool shows in Progressing only.
    is_ready = (ready >= 1 or plan.replicas == 0) and gw_ready >= 1
    progressing = ready < plan.replicas or gw_ready < 1
    message = f"{ready}/{plan.replicas} engine replicas ready, {gw_ready} gateway ready"
    if live.prefill is not None:
        p_ready = write_prefill_status(patch, o, live.prefill, plan.prefill_replicas)
        progressing = progressing or p_ready < plan.prefill_replicas
        message += f", {p_ready}/{plan.prefill_replicas} prefill replicas ready"
    elif status.get("prefill") is not None:
        patch.status["prefill"] = None  # spec.prefill removed: so is its column
    conditions = [
        condition("Ready", is_ready, "Serving" if is_ready else "Starting", message,
                  o.generation),
        condition("Progressing", progressing, "ScalingOrStarting" if progressing else "Stable",
                  message, o.generation),
        degraded(plan.tenants_problem, adapters, o, status),
    ]
    patch.status.update({
        "observedGeneration": o.generation, "replicas": current, "readyReplicas": ready,
        "desiredReplicas": plan.replicas, "selector": selector_string(o),
        "endpoint": endpoint_url(o),
        "conditions": merge_conditions(status.get("conditions"), conditions)})


def write_prefill_status(patch, o: Owner, pool: dict, desired: int) -> int:
    """status.prefill from the prefill Deployment read back; its ready replicas."""
    p_ready = replica_count(pool, "readyReplicas")
    metrics.record_replicas(o.namespace, o.name, "prefill", desired,
                            replica_count(pool, "replicas"))
    update_prefill_status(patch, {
        "replicas": replica_count(pool, "replicas"),
        "readyReplicas": p_ready, "desiredReplicas": desired,
        "ready": f"{p_ready}/{desired}"})
    return p_ready


async def sync_adapters(patch, o: Owner, status: dict, body) -> lora.Report | None:
    """Bring every ready engine's adapters to spec.adapters (``lora_sync``) and write
    status.adapters; None when LoRA is off or the pass could not run."""
    if not lora.enabled(o.spec):
        if status.get("adapters") is not None:
            patch.status["adapters"] = None
        return None
    report = await lora_sync.sync(body, o)
    if report is not None:
        patch.status["adapters"] = report.adapters
    return report


def degraded(tenants_problem: str | None, adapters: lora.Report | None, o: Owner,
             status: dict) -> dict:
    """A bad tenants file first, then adapters the engines refused. A pass that could
    not list the engines keeps the adapters' last verdict."""
    if tenants_problem:
        return condition("Degraded", True, "InvalidTenants", tenants_problem, o.generation)
    if adapters is None and lora.enabled(o.spec):
        old = next((c for c in status.get("conditions") or []
                    if c.get("type") == "Degraded" and c.get("reason") == ADAPTER_FAILED), None)
        if old is not None:
            return condition("Degraded", True, ADAPTER_FAILED, old.get("message", ""),
                             o.generation)
    if adapters is not None and adapters.problem:
        return condition("Degraded", True, ADAPTER_FAILED, adapters.problem, o.generation)
    return condition("Degraded", False, "AsExpected", "", o.generation)


class ConvergeError(Exception):
    """An API call of ``converge`` failed; the message names the step."""


async def create_once(api, body, once: list[dict]) -> str | None:
    """Create the children made once that are missing (before the pods that read
    them); the fingerprint of the kv-transfer Secret's value, which may be one a user
    made (None without spec.prefill)."""
    fingerprint = None
    for manifest in once:
        name = manifest["metadata"]["name"]
        try:
            live, created = await kube.create_if_absent(api, manifest)
        except client.exceptions.ApiException as e:
            raise ConvergeError(f"creating {manifest['kind']} {name} failed: {e.status} "
                                f"{e.reason}: {api_message(e)}") from e
        if created:
            kopf.info(body, reason="Created", message=f"created {manifest['kind']} {name}")
        fingerprint = secret_fingerprint(live)
        if fingerprint is None:
            raise ConvergeError(f"Secret {name} has no key {KV_SECRET_KEY!r}: the engines "
                                f"read their shared secret from it; delete the Secret (the "
                                f"operator makes a new one) or add the key")
    return fingerprint


async def converge(api, body, o: Owner, desired: list[dict], once: list[dict]) -> None:
    """Apply every desired child, then prune those of ours it no longer has (after, so
    whatever replaces a child, e.g. a gateway no longer pointed at its peers or at a
    prefill pool, is in place before the child goes). ``once``: the children
    ``create_once`` made, kept."""
    step = ""
    try:
        for manifest in desired:
            step = f"applying {manifest['kind']} {manifest['metadata']['name']}"
            await kube.apply(api, manifest)
        step = "listing children to prune"
        live = await kube.list_children(api, o.namespace, children_selector(o))
        wanted = {(m["kind"], m["metadata"]["name"]) for m in once}
        for kind, name in named_children(o):
            if (kind, name) not in wanted:  # read only what may have to go
                step = f"reading {kind} {name} to prune"
                obj = await kube.read_named(api, o.namespace, kind, name)
                live += [obj] if obj is not None else []
        for obj in stale_children(o, [*desired, *once], live):
            step = f"pruning {obj['kind']} {obj['metadata']['name']}"
            await kube.delete(api, obj)
            kopf.info(body, reason="Pruned", message=f"deleted {obj['kind']} "
                      f"{obj['metadata']['name']}: the spec no longer calls for it")
    except client.exceptions.ApiException as e:
        raise ConvergeError(f"{step} failed: {e.status} {e.reason}: {api_message(e)}") from e


async def check_tenants(api, o: Owner) -> None:
    """A tenants file the gateway could not use is the spec's fault: Degraded, with
    the gateway's own message, rather than a gateway that fails to start."""
    ref = tenants_secret(o)
    if ref is None:
        return
    name, key = ref
    data = await kube.read_secret_value(api, o.namespace, name, key)
    if data is None:
        raise SpecError(f"gateway.tenantsSecret: Secret {name!r} does not exist or has no "
                        f"key {key!r}")
    try:
        parse_tenants_file(data, f"gateway.tenantsSecret {name}/{key}")
    except TenantsError as e:
        raise SpecError(str(e)) from e


def api_message(e: client.exceptions.ApiException) -> str:
    try:
        return json.loads(e.body).get("message", "")[:300]
    except (TypeError, ValueError):
        return ""


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
@kopf.on.resume(GROUP, VERSION, PLURAL)
async def on_change(body, patch, logger, **_) -> None:
    await reconcile(body, patch, logger)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
async def on_delete(body, **_) -> None:
    uid = body["metadata"]["uid"]
    metrics.forget(body["metadata"]["namespace"], body["metadata"]["name"])
    _histories.pop(uid, None)  # children go by garbage collection
    _histories.pop(f"{uid}/prefill", None)
    lora_sync.forget(uid)


@kopf.timer(GROUP, VERSION, PLURAL, interval=10.0, initial_delay=5.0)
async def tick(body, patch, logger, **_) -> None:
    """Re-apply (drift repair), scrape, autoscale, refresh the status."""
    o = owner_of(body)
    auto = o.spec.get("autoscaling") or {}
    if auto.get("enabled"):
        await autoscale(body, patch, o, auto)
        if has_prefill(o.spec):
            await autoscale_prefill(body, patch, o)
        body = {**body, "status": {**(body.get("status") or {}), **patch.status}}
    else:
        await observe_only(body, patch, o)
    await reconcile(body, patch, logger)


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    """Each metric of ``url`` summed over its label sets; None if it did not answer."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=3)) as r:
            if r.status != 200:
                return None
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None
    return sum_by_name(text)


async def observe(o: Owner, component: str = "engine") -> Observation | None:
    """Sum one pool's queues and waiting prompt tokens, average its KV usage; None if
    any ready engine could not be scraped (a partial view must not drive a decision).
    The gateway's held requests count as demand for the main pool only."""
    port = o.spec.get("engine", {}).get("port", 8000)
    async with client.ApiClient() as api:
        ips = await kube.ready_pod_ips(api, o.namespace, selector_string(o, component))
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(scrape(session, f"http://{ip}:{port}/metrics")
                                         for ip in ips))
        gateway = (await scrape(session, f"{endpoint_url(o)}/metrics")
                   if component == "engine" else None)
    demand = (gateway or {}).get("llmserve_gateway_queued_requests", 0.0)
    if not ips:
        return Observation(0, 0, 0, 0, demand_at_zero=demand)
    if any(r is None for r in results):
        return None
    return Observation(waiting=sum(r.get(WAITING, 0.0) for r in results),
                       running=sum(r.get(RUNNING, 0.0) for r in results),
                       kv_usage=sum(r.get(KV_USAGE, 0.0) for r in results) / len(results),
                       ready_replicas=len(ips), demand_at_zero=demand,
                       waiting_prompt_tokens=sum(r.get(WAITING_PROMPT_TOKENS, 0.0)
                                                 for r in results))


def prefill_load(obs: Observation) -> dict:
    return {"queueDepth": obs.waiting, "waitingPromptTokens": obs.waiting_prompt_tokens}


async def observe_only(body, patch, o: Owner) -> None:
    obs = await observe(o)
    metrics.record_observation(o.namespace, o.name, "engine", obs)
    if obs is not None and obs.ready_replicas:
        patch.status["queueDepth"] = obs.waiting
        patch.status["kvCacheUtilization"] = f"{100 * obs.kv_usage:.0f}%"
    if has_prefill(o.spec):
        pool = await observe(o, "prefill")
        metrics.record_observation(o.namespace, o.name, "prefill", pool)
        if pool is not None and pool.ready_replicas:
            update_prefill_status(patch, prefill_load(pool))


async def autoscale(body, patch, o: Owner, auto: dict) -> None:
    status = body.get("status") or {}
    current = int(status.get("desiredReplicas", status.get("replicas", 0)) or 0)
    obs = await observe(o)
    history = _histories.setdefault(o.uid, History())
    policy = Policy.from_spec(o.spec)
    decision = decide(current, obs, policy, history, time.monotonic())
    metrics.record_decision(o.namespace, o.name, "engine", current, policy, obs, decision)
    if obs is not None and obs.ready_replicas:
        patch.status["queueDepth"] = obs.waiting
        patch.status["kvCacheUtilization"] = f"{100 * obs.kv_usage:.0f}%"
    patch.status["desiredReplicas"] = decision.replicas
    if decision.replicas != current:
        patch.status["lastScaleTime"] = now_iso()
        patch.status["lastScaleReason"] = decision.reason
        kopf.info(body, reason="Scaled",
                  message=f"engine replicas {current} -> {decision.replicas}: {decision.reason}")


async def autoscale_prefill(body, patch, o: Owner) -> None:
    """The prefill pool's own decision: waiting prompt tokens and queue depth against
    its targets, within spec.prefill's bounds (``Policy.for_prefill``)."""
    pool = (body.get("status") or {}).get("prefill") or {}
    current = int(pool.get("desiredReplicas", pool.get("replicas", 0)) or 0)
    if patch.status.get("desiredReplicas") == 0:  # the decode pool scaled to zero
        update_prefill_status(patch, {"desiredReplicas": 0})
        return
    obs = await observe(o, "prefill")
    history = _histories.setdefault(f"{o.uid}/prefill", History())
    policy = Policy.for_prefill(o.spec)
    decision = decide(current, obs, policy, history, time.monotonic())
    metrics.record_decision(o.namespace, o.name, "prefill", current, policy, obs, decision)
    fields = {"desiredReplicas": decision.replicas}
    if obs is not None and obs.ready_replicas:
        fields.update(prefill_load(obs))
    if decision.replicas != current:
        fields.update(lastScaleTime=now_iso(), lastScaleReason=decision.reason)
        kopf.info(body, reason="Scaled", message=f"prefill replicas {current} -> "
                  f"{decision.replicas}: {decision.reason}")
    update_prefill_status(patch, fields)
