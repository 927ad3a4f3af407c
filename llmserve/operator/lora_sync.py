"""Multi-LoRA, the operator's I/O: read each ready engine's adapters, carry out
``lora.plan`` through the engine's API, and report (``lora.report``).

Runs on every reconcile (spec changes and the 10-second timer), so an engine that
becomes ready gets the adapters within a tick, and an edit of spec.adapters reaches
the engines at once. Only pods started with ``--enable-lora`` are asked: during the
rollout that turns LoRA on, the old pods would refuse every load.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
import kopf
from kubernetes_asyncio import client

from llmserve.operator import kube, lora
from llmserve.operator.builders import Owner, desired_adapters, selector_string

log = logging.getLogger("llmserve.operator.lora")
READ_TIMEOUT = aiohttp.ClientTimeout(total=5)
UNLOAD_TIMEOUT = aiohttp.ClientTimeout(total=30)
# An hf:// adapter may be downloaded during the load; past this the load counts as
# pending (the engine may finish it: the next pass reads /v1/models again).
LOAD_TIMEOUT = aiohttp.ClientTimeout(total=120)

_failures: dict[str, lora.Failures] = {}  # LLMDeployment uid -> refused loads
_locks: dict[str, asyncio.Lock] = {}  # one pass at a time per LLMDeployment (timer, edits)


def forget(uid: str) -> None:
    _failures.pop(uid, None)
    _locks.pop(uid, None)


async def sync(body, o: Owner) -> lora.Report | None:
    """One pass over the ready engines; None if the pods could not be listed."""
    desired = desired_adapters(o)
    try:
        async with client.ApiClient() as api:
            pods = await kube.ready_pods(api, o.namespace, selector_string(o))
    except client.exceptions.ApiException as e:
        log.warning("%s/%s: listing engine pods for adapters failed: %s", o.namespace,
                    o.name, e.reason)
        return None
    async with _locks.setdefault(o.uid, asyncio.Lock()):
        failures = _failures.setdefault(o.uid, lora.Failures())
        failures.keep_only({p.uid for p in pods}, desired)
        key = lora.api_key(o.spec)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        port = o.spec.get("engine", {}).get("port", 8000)
        async with aiohttp.ClientSession(headers=headers) as session:
            engines = await asyncio.gather(*(
                sync_engine(Engine(session, body, p, f"http://{p.ip}:{port}"), desired,
                                   failures) for p in pods))
        return lora.report(desired, list(engines), failures)


class Engine:
    """One engine pod's adapter API."""

    def __init__(self, session: aiohttp.ClientSession, body, pod: kube.ReadyPod, url: str):
        self.session, self.body, self.pod, self.url = session, body, pod, url

    async def adapters(self) -> dict[str, str] | None:
        """name -> root of its adapters; None if it did not answer."""
        try:
            async with self.session.get(f"{self.url}/v1/models", timeout=READ_TIMEOUT) as r:
                if r.status != 200:
                    return None
                return lora.loaded_adapters(await r.json(content_type=None))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return None

    async def post(self, path: str, payload: dict, timeout) -> tuple[int | None, str]:
        """(HTTP status or None without an answer, the engine's message)."""
        try:
            async with self.session.post(f"{self.url}{path}", json=payload,
                                         timeout=timeout) as r:
                return r.status, error_message(await r.text())
        except asyncio.TimeoutError:
            return None, f"no answer within {timeout.total:.0f} s"
        except (aiohttp.ClientError, OSError) as e:
            return None, f"{type(e).__name__}: {e}"


def error_message(text: str) -> str:
    """The message of an OpenAI-shaped error (or vLLM's older flat one), else the text."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if body.get("message"):
            return str(body["message"])
    return text.strip()[:500]


async def sync_engine(e: Engine, desired: list[lora.Adapter], failures: lora.Failures
                      ) -> lora.EngineState:
    if lora.ENABLE_FLAG not in e.pod.args:  # an old pod of the rollout that enables LoRA
        return lora.EngineState(e.pod.uid, None)
    loaded = await e.adapters()
    if loaded is None:
        return lora.EngineState(e.pod.uid, None)
    pending: dict[str, str] = {}
    done: dict[str, list[str]] = {"load": [], "unload": []}
    by_name = {a.name: a for a in desired}
    for action in lora.plan(desired, loaded, failures, e.pod.uid, time.monotonic()):
        if action.kind == "unload":
            ok = await unload(e, action.name, loaded)
        elif action.name in loaded:  # its unload failed: the engine would refuse the name
            pending[action.name] = (f"{e.pod.name} still holds {action.name} from "
                                    f"{loaded[action.name]}")
            ok = False
        else:
            ok = await load(e, by_name[action.name], loaded, pending, failures)
        if ok:
            done[action.kind].append(action.name)
    # One event per engine and pass (a new engine may take many adapters at once).
    if done["unload"]:
        kopf.info(e.body, reason="AdaptersUnloaded", message=f"{e.pod.name}: unloaded "
                  f"{', '.join(done['unload'])} (no longer in spec.adapters or moved)")
    if done["load"]:
        kopf.info(e.body, reason="AdaptersLoaded",
                  message=f"{e.pod.name}: loaded {', '.join(done['load'])}")
    return lora.EngineState(e.pod.uid, loaded, pending)


async def unload(e: Engine, name: str, loaded: dict[str, str]) -> bool:
    status, message = await e.post("/v1/unload_lora_adapter", {"lora_name": name},
                                   UNLOAD_TIMEOUT)
    if status in (200, 404):  # 404: gone already
        loaded.pop(name, None)
        return True
    log.warning("unloading %s from %s: %s %s", name, e.pod.name, status, message)
    return False


async def load(e: Engine, a: lora.Adapter, loaded: dict[str, str], pending: dict[str, str],
               failures: lora.Failures) -> bool:
    status, message = await e.post("/v1/load_lora_adapter",
                                   {"lora_name": a.name, "lora_path": a.path}, LOAD_TIMEOUT)
    if status is not None and 400 <= status < 500:
        # A pass racing this one may have loaded it (vLLM refuses a second load of a name).
        now = await e.adapters()
        if now is not None and now.get(a.name) == a.path:
            status = 200
    if status == 200:
        loaded[a.name] = a.path
        failures.record(e.pod.uid, a, None, time.monotonic())
        return True
    if status is not None and 400 <= status < 500:  # the engine's verdict on the adapter
        failures.record(e.pod.uid, a, message or f"HTTP {status}", time.monotonic())
        kopf.warn(e.body, reason="AdapterLoadFailed",
                  message=f"adapter {a.name} ({a.source}) on {e.pod.name}: {message}")
    else:  # no verdict (a timeout, a 5xx): tried again next pass
        pending[a.name] = f"loading on {e.pod.name}: {message or f'HTTP {status}'}"
    return False
