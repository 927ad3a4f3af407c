"""Stand-in for the container runtime on the fake nodes: each pod bound to an
``e2e-node-*`` node runs as local processes.

Per pod: a network namespace on the cluster bridge with the pod's own IP, a
private mount namespace where the pod's emptyDir and Secret volumes are bind
mounted at their mountPaths, the container's command and arguments with the pod's
environment, and — unless automounting is off — a kubeconfig holding a token for
the pod's ServiceAccount from the TokenRequest API, so in-cluster clients are held
to the RBAC the chart grants. Readiness probes are run against the pod IP and
reported in the pod status (which drives EndpointSlices). A pod being deleted gets
SIGTERM, then SIGKILL after its grace period, and is then removed from the API.

Everything else — scheduling, controllers, garbage collection, EndpointSlices — is
the real control plane.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import logging
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from kubernetes_asyncio import client, config, watch

from e2e.cluster import BRIDGE, BRIDGE_IP, POD_NETNS_PREFIX, POD_PREFIX, POD_SUBNET

log = logging.getLogger("podrunner")
NODE_PREFIX = "e2e-node-"
VENV_BIN = Path(sys.executable).parent


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def run(*args: str, check: bool = True) -> None:
    subprocess.run(args, check=check, capture_output=True)


@dataclass
class PodProcess:
    uid: str
    namespace: str
    name: str
    ip: str
    netns: str
    dir: Path
    spec: dict
    proc: subprocess.Popen | None = None
    ready: bool = False
    restarts: int = 0
    stopping: bool = False
    tasks: list = field(default_factory=list)


class PodRunner:
    def __init__(self, kubeconfig: Path, server: str, ca: Path, workdir: Path):
        self.kubeconfig, self.server, self.ca = kubeconfig, server, ca
        self.workdir = workdir
        self.pods: dict[str, PodProcess] = {}
        self.free_ips = [f"{POD_SUBNET}.{i}" for i in range(254, 1, -1)]
        self.api: client.ApiClient | None = None
        self._stopping: set[asyncio.Task] = set()

    # --- main loop --------------------------------------------
    async def run(self) -> None:
        await config.load_kube_config(config_file=str(self.kubeconfig))
        async with client.ApiClient() as api:
            self.api = api
            core = client.CoreV1Api(api)
            try:
                while True:
                    try:
                        w = watch.Watch()
                        async for event in w.stream(core.list_pod_for_all_namespaces,
                                                    timeout_seconds=120):
                            await self.on_event(event["type"], event["object"])
                    except Exception as e:  # noqa: BLE001 - keep running through API blips
                        log.warning("pod watch: %r", e)
                        await asyncio.sleep(0.5)
            finally:  # cancelled (the cluster is going down), wherever it was waiting
                await self.stop_all()

    async def on_event(self, kind: str, pod) -> None:
        node = pod.spec.node_name or ""
        if not node.startswith(NODE_PREFIX):
            return
        uid = pod.metadata.uid
        if kind == "DELETED" or pod.metadata.deletion_timestamp is not None:
            if uid in self.pods and not self.pods[uid].stopping:
                # Marked here, not in stop(): the watch can hand over the DELETED
                # event before the stop task first runs, and a second stop would
                # free the pod's IP twice (two later pods then shared one address).
                self.pods[uid].stopping = True
                grace = pod.metadata.deletion_grace_period_seconds
                task = asyncio.create_task(self.stop(self.pods[uid], grace,
                                                     remove=kind != "DELETED"))
                self._stopping.add(task)
                task.add_done_callback(self._stop_done)
            return
        if uid not in self.pods and pod.status.phase in (None, "Pending"):
            await self.start(self.api.sanitize_for_serialization(pod))

    # --- start --------------------------------------------
    async def start(self, pod: dict) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        uid = meta["uid"]
        ip = self.free_ips.pop()
        p = PodProcess(uid, meta["namespace"], meta["name"], ip, f"{POD_NETNS_PREFIX}{uid[:12]}",
                       self.workdir / "pods" / uid, spec)
        self.pods[uid] = p
        p.dir.mkdir(parents=True, exist_ok=True)
        self.make_netns(p)
        env = await self.environment(p, pod)
        mounts = self.unshadowed(await self.volumes(p), env, p)
        container = spec["containers"][0]
        argv = [*container.get("command", []), *container.get("args", [])]
        if argv and not os.path.isabs(argv[0]) and (VENV_BIN / argv[0]).exists():
            argv[0] = str(VENV_BIN / argv[0])
        script = "".join(f'mkdir -p "{dst}" && mount --bind "{src}" "{dst}" && '
                         for src, dst in mounts) + 'exec "$@"'
        p.cmd = ["ip", "netns", "exec", p.netns, "unshare", "--mount", "--propagation",
                 "private", "sh", "-c", script, "container", *argv]
        p.env = env
        self.launch(p)
        await self.patch_status(p, started=True)
        p.tasks.append(asyncio.create_task(self.probe_loop(p, container)))
        p.tasks.append(asyncio.create_task(self.restart_loop(p)))
        log.info("started %s/%s at %s: %s", p.namespace, p.name, ip, " ".join(argv))

    @staticmethod
    def unshadowed(mounts, env: dict, p: PodProcess) -> list[tuple[str, str]]:
        """Drop mounts that would hide this checkout or its virtualenv (e.g. an
        emptyDir at /tmp when the repository lives under /tmp): the processes stand in
        for an image and must still find their code. /tmp becomes TMPDIR instead."""
        keep = [str(Path(sys.prefix).resolve()), str(Path(__file__).resolve().parents[1])]
        out = []
        for src, dst in mounts:
            d = dst.rstrip("/") or "/"
            if any(k == d or k.startswith(d + "/") for k in keep):
                if d == "/tmp":
                    env["TMPDIR"] = src
                continue
            out.append((src, dst))
        return out

    def launch(self, p: PodProcess) -> None:
        out = open(p.dir / "container.log", "ab")
        p.proc = subprocess.Popen(p.cmd, env=p.env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)

    def make_netns(self, p: PodProcess) -> None:
        host_if = f"v{p.uid[:10]}"
        run("ip", "netns", "add", p.netns)
        run("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0",
            "netns", p.netns)
        run("ip", "link", "set", host_if, "master", BRIDGE, "up")
        for args in (("addr", "add", f"{p.ip}/{POD_PREFIX}", "dev", "eth0"),
                     ("link", "set", "eth0", "up"), ("link", "set", "lo", "up"),
                     ("route", "add", "default", "via", BRIDGE_IP)):
            run("ip", "netns", "exec", p.netns, "ip", *args)

    async def environment(self, p: PodProcess, pod: dict) -> dict:
        env = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": str(p.dir / "home"),
               "PYTHONUNBUFFERED": "1", "HOSTNAME": p.name}
        # What the image would bake in: the converted built-in model.
        if os.environ.get("LLMSERVE_CACHE"):
            env["LLMSERVE_CACHE"] = os.environ["LLMSERVE_CACHE"]
        # The code the "image" holds: this checkout even when the virtualenv's editable
        # install points at another one (a git worktree sharing the venv).
        if os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        Path(env["HOME"]).mkdir(exist_ok=True)
        core = client.CoreV1Api(self.api)
        fields = {"metadata.name": p.name, "metadata.namespace": p.namespace,
                  "status.podIP": p.ip, "spec.nodeName": p.spec.get("nodeName", ""),
                  "spec.serviceAccountName": p.spec.get("serviceAccountName", "default")}
        for var in pod["spec"]["containers"][0].get("env", []):
            if "value" in var:
                env[var["name"]] = var["value"]
            elif "fieldRef" in var.get("valueFrom", {}):
                env[var["name"]] = fields.get(var["valueFrom"]["fieldRef"]["fieldPath"], "")
            elif "secretKeyRef" in var.get("valueFrom", {}):
                ref = var["valueFrom"]["secretKeyRef"]
                secret = await core.read_namespaced_secret(ref["name"], p.namespace)
                env[var["name"]] = base64.b64decode(secret.data[ref["key"]]).decode()
        # As the kubelet does: where the API server is, for in-cluster clients.
        host, _, port = self.server.removeprefix("https://").partition(":")
        env.update(KUBERNETES_SERVICE_HOST=host, KUBERNETES_SERVICE_PORT=port)
        return env

    async def service_account_token(self, p: PodProcess, expiration: int) -> str:
        """A token bound to this pod, from the TokenRequest API."""
        sa = p.spec.get("serviceAccountName") or "default"
        core = client.CoreV1Api(self.api)
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                   "spec": {"expirationSeconds": max(expiration, 3600),
                            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                                               "name": p.name, "uid": p.uid}}}
        token = await core.create_namespaced_service_account_token(sa, p.namespace, request)
        return token.status.token

    async def projected(self, p: PodProcess, d: Path, sources: list[dict]) -> None:
        """The ServiceAccount volume the API server injects: token, CA, namespace."""
        for src in sources:
            if "serviceAccountToken" in src:
                sat = src["serviceAccountToken"]
                token = await self.service_account_token(p, sat.get("expirationSeconds", 3600))
                (d / sat["path"]).write_text(token)
            elif "configMap" in src and src["configMap"]["name"] == "kube-root-ca.crt":
                for item in src["configMap"].get("items", []):
                    (d / item["path"]).write_text(self.ca.read_text())
            elif "downwardAPI" in src:
                for item in src["downwardAPI"].get("items", []):
                    if item.get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
                        (d / item["path"]).write_text(p.namespace)

    async def volumes(self, p: PodProcess) -> list[tuple[str, str]]:
        """(host dir, mountPath) bind mounts for emptyDir, Secret and the
        ServiceAccount's projected volumes."""
        core = client.CoreV1Api(self.api)
        sources = {}
        for vol in p.spec.get("volumes", []) or []:
            d = p.dir / "volumes" / vol["name"]
            d.mkdir(parents=True, exist_ok=True)
            if "projected" in vol:
                await self.projected(p, d, vol["projected"].get("sources", []))
            elif "secret" in vol:
                secret = await core.read_namespaced_secret(vol["secret"]["secretName"],
                                                           p.namespace)
                items = vol["secret"].get("items") or [{"key": k, "path": k}
                                                        for k in (secret.data or {})]
                for item in items:
                    (d / item["path"]).write_bytes(base64.b64decode(secret.data[item["key"]]))
            sources[vol["name"]] = d
        mounts = []
        for m in p.spec["containers"][0].get("volumeMounts", []) or []:
            if m["name"] in sources:
                mounts.append((str(sources[m["name"]]), m["mountPath"]))
        return mounts

    # --- status --------------------------------------------
    async def patch_status(self, p: PodProcess, started: bool = False) -> None:
        c = p.spec["containers"][0]
        running = p.proc is not None and p.proc.poll() is None
        state = ({"running": {"startedAt": now()}} if running else
                 {"waiting": {"reason": "CrashLoopBackOff"}})
        ready = "True" if p.ready and running else "False"
        status = {"phase": "Running", "podIP": p.ip, "podIPs": [{"ip": p.ip}],
                  "hostIP": BRIDGE_IP, "hostIPs": [{"ip": BRIDGE_IP}],
                  "conditions": [
                      {"type": "PodScheduled", "status": "True"},
                      {"type": "Initialized", "status": "True"},
                      {"type": "ContainersReady", "status": ready,
                       "lastTransitionTime": now()},
                      {"type": "Ready", "status": ready, "lastTransitionTime": now()}],
                  "containerStatuses": [{
                      "name": c["name"], "image": c.get("image", ""), "imageID": "",
                      "containerID": f"e2e://{p.uid}", "ready": ready == "True",
                      "started": running, "restartCount": p.restarts, "state": state}]}
        if started:
            status["startTime"] = now()
        core = client.CoreV1Api(self.api)
        try:
            await core.patch_namespaced_pod_status(p.name, p.namespace, {"status": status})
        except client.exceptions.ApiException as e:
            if e.status != 404:
                raise

    async def probe_loop(self, p: PodProcess, container: dict) -> None:
        probe = container.get("readinessProbe") or {}
        get = probe.get("httpGet")
        ports = {x.get("name"): x["containerPort"] for x in container.get("ports", [])}
        async with aiohttp.ClientSession() as session:
            while not p.stopping:
                ok = p.proc is not None and p.proc.poll() is None
                if ok and get:
                    port = get["port"] if isinstance(get["port"], int) else ports[get["port"]]
                    try:
                        async with session.get(f"http://{p.ip}:{port}{get.get('path', '/')}",
                                               timeout=aiohttp.ClientTimeout(total=1)) as r:
                            ok = 200 <= r.status < 400
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                        ok = False
                if ok != p.ready:
                    p.ready = ok
                    await self.patch_status(p)
                await asyncio.sleep(0.5)

    async def restart_loop(self, p: PodProcess) -> None:
        backoff = 1.0
        while not p.stopping:
            await asyncio.sleep(0.5)
            if p.proc.poll() is not None and not p.stopping:
                log.warning("%s/%s exited with %s", p.namespace, p.name, p.proc.returncode)
                p.ready = False
                await self.patch_status(p)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10)
                if not p.stopping:
                    p.restarts += 1
                    self.launch(p)
                    await self.patch_status(p)

    # --- stop --------------------------------------------
    async def stop(self, p: PodProcess, grace: int | None, remove: bool) -> None:
        p.stopping = True
        for t in p.tasks:
            t.cancel()
        if p.proc is not None and p.proc.poll() is None:
            os.killpg(p.proc.pid, signal.SIGTERM)
            deadline = asyncio.get_running_loop().time() + (30 if grace is None else grace)
            while p.proc.poll() is None and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)
            if p.proc.poll() is None:
                os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait()
        run("ip", "netns", "del", p.netns, check=False)
        self.release_ip(p.ip)
        self.pods.pop(p.uid, None)
        if remove:  # as the kubelet does: confirm the deletion once the pod is gone
            core = client.CoreV1Api(self.api)
            try:
                await core.delete_namespaced_pod(p.name, p.namespace, grace_period_seconds=0)
            except client.exceptions.ApiException as e:
                if e.status != 404:
                    raise
        shutil.rmtree(p.dir, ignore_errors=True)
        log.info("stopped %s/%s", p.namespace, p.name)

    def _stop_done(self, task: asyncio.Task) -> None:
        self._stopping.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("stopping a pod failed: %r", task.exception())

    def release_ip(self, ip: str) -> None:
        # Reused last, as a CNI's allocator does: a client still holding the old
        # pod's address (an endpoint cache, a keep-alive) must not reach a new pod.
        if ip not in self.free_ips:
            self.free_ips.insert(0, ip)

    async def stop_all(self) -> None:
        await asyncio.gather(*self._stopping, return_exceptions=True)
        # Every pod still here: never asked to stop, or its stop task failed midway.
        await asyncio.gather(*(self.stop(p, 5, remove=False) for p in list(self.pods.values())),
                             return_exceptions=True)

    def running_pods(self) -> list[str]:
        return [f"{p.namespace}/{p.name}" for p in self.pods.values()
                if p.proc is not None and p.proc.poll() is None]
