"""A local Kubernetes control plane from the binaries `e2e/controlplane/build.sh` makes.

etcd, kube-apiserver (client-certificate and service-account-token auth, RBAC),
kube-controller-manager (deployments, garbage collection, EndpointSlices, ...) and
kube-scheduler, on this machine, with fake nodes. The API server listens on a
bridge address so processes in pod network namespaces (see podrunner.py) reach it.

    python -m e2e.cluster up     # prints KUBECONFIG=...; Ctrl-C stops everything
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

K8S_VERSION = os.environ.get("K8S_VERSION", "v1.37.2")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
BIN_DIR = Path(os.environ.get("BIN_DIR", CACHE / "llmserve" / "controlplane" / K8S_VERSION / "bin"))
# Each cluster on this machine has a network slot: its own bridge, /24 and pod
# namespace prefix, so that clusters side by side (one per pytest-xdist worker: gw0,
# gw1, ...) never share an address, and one tearing down removes only its own pods.
# LLMSERVE_E2E_SLOT is a base the worker's number adds to (clear of a cluster in slot 0
# started by hand: LLMSERVE_E2E_SLOT=1 make e2e uses slots 1 and 2).
SLOT = (int(os.environ.get("LLMSERVE_E2E_SLOT") or 0)
        + int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0))
if not 0 <= SLOT <= 254:
    raise ValueError(f"e2e network slot {SLOT}: one of 0..254 (the third byte of 10.244.X.0/24)")
BRIDGE = f"llmbr{SLOT}"
POD_SUBNET = f"10.244.{SLOT}"  # only on our own bridge: .1 is the bridge, pods get .2 .. .254
BRIDGE_IP = f"{POD_SUBNET}.1"
POD_PREFIX = 24
SERVICE_CIDR = "10.96.0.0/16"  # allocated by each API server, never routed
POD_NETNS_PREFIX = f"llmpod{SLOT}-"


def binary(name: str) -> Path:
    path = BIN_DIR / name
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: run e2e/controlplane/build.sh first")
    return path


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, capture_output=True, text=True)


# --- network: one bridge that pod namespaces attach to ---------------------------------------
def fresh_network() -> None:
    """Remove pod namespaces and the bridge a crashed run may have left (a stale pod
    holding an address would answer for the new one), then make the bridge anew."""
    remove_network()
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{BRIDGE_IP}/{POD_PREFIX}", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")


def remove_network() -> None:
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(POD_NETNS_PREFIX):
            sh("ip", "netns", "del", name, check=False)
    sh("ip", "link", "del", BRIDGE, check=False)


# --- certificates --------------------------------------------
def make_certs(d: Path) -> None:
    """A CA, the API server's serving certificate, an admin client certificate
    (group system:masters) and the service-account signing key."""
    d.mkdir(parents=True, exist_ok=True)

    def ossl(*args):
        sh("openssl", *args)

    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650", "-subj",
         "/CN=llmserve-e2e-ca", "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"))
    (d / "san.cnf").write_text(
        "[req]\ndistinguished_name=dn\n[dn]\n[ext]\nsubjectAltName=" +
        ",".join([f"IP:{BRIDGE_IP}", "IP:127.0.0.1", "IP:10.96.0.1", "DNS:localhost",
                  "DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc"])
        + "\nextendedKeyUsage=serverAuth\n")
    for name, subj, ext in (("apiserver", "/CN=kube-apiserver", "ext"),
                            ("admin", "/O=system:masters/CN=e2e-admin", None)):
        ossl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subj,
             "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"))
        extra = ["-extfile", str(d / "san.cnf"), "-extensions", ext] if ext else []
        ossl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.crt"),
             "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "3650",
             "-out", str(d / f"{name}.crt"), *extra)
    ossl("genrsa", "-out", str(d / "sa.key"), "2048")
    ossl("rsa", "-in", str(d / "sa.key"), "-pubout", "-out", str(d / "sa.pub"))


def kubeconfig(server: str, ca: Path, user: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Config", "current-context": "e2e",
            "clusters": [{"name": "e2e", "cluster": {"server": server,
                                                      "certificate-authority": str(ca)}}],
            "users": [{"name": "e2e", "user": user}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "e2e"}}]}


# --- the cluster --------------------------------------------
class Cluster:
    def __init__(self, workdir: Path | None = None, nodes: int = 1):
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="llmserve-e2e-"))
        self.num_nodes = nodes
        self.procs: dict[str, subprocess.Popen] = {}
        self.args: dict[str, list[str]] = {}
        self.port = free_port()
        self.server = f"https://{BRIDGE_IP}:{self.port}"
        self.kubeconfig = self.dir / "admin.kubeconfig"
        self.timings: dict[str, float] = {}

    def _start(self, name: str, args: list[str]) -> None:
        log = open(self.dir / f"{name}.log", "a")
        self.args[name] = args
        self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def restart(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill one control-plane process (SIGKILL: a crash) and start it again with the
        same arguments (etcd keeps the state); returns once the API server is ready."""
        p = self.procs[name]
        os.killpg(p.pid, sig)
        p.wait(30)
        self._start(name, self.args[name])
        self.wait_healthy()

    def up(self) -> Cluster:
        t0 = time.monotonic()
        certs = self.dir / "certs"
        make_certs(certs)
        fresh_network()
        etcd_port, etcd_peer = free_port(), free_port()
        self._start("etcd", [str(binary("etcd")), "--data-dir", str(self.dir / "etcd"),
                             "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                             "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                             "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                             "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer}",
                             "--unsafe-no-fsync", "--log-level", "warn"])
        self._start("kube-apiserver", [
            str(binary("kube-apiserver")),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            f"--bind-address={BRIDGE_IP}", f"--advertise-address={BRIDGE_IP}",
            f"--secure-port={self.port}",
            f"--tls-cert-file={certs / 'apiserver.crt'}",
            f"--tls-private-key-file={certs / 'apiserver.key'}",
            f"--client-ca-file={certs / 'ca.crt'}",
            f"--service-account-key-file={certs / 'sa.pub'}",
            f"--service-account-signing-key-file={certs / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NamespaceLifecycle,ServiceAccount,DefaultStorageClass",
            "--allow-privileged=false", "--v=1"])
        self.kubeconfig.write_text(json.dumps(kubeconfig(
            self.server, certs / "ca.crt",
            {"client-certificate": str(certs / "admin.crt"),
             "client-key": str(certs / "admin.key")})))
        self.wait_healthy()
        self.timings["apiserver_ready_s"] = time.monotonic() - t0
        cm = self.dir / "controller-manager.kubeconfig"
        shutil.copy(self.kubeconfig, cm)
        self._start("kube-controller-manager", [
            str(binary("kube-controller-manager")), f"--kubeconfig={cm}",
            "--leader-elect=false", "--use-service-account-credentials=false",
            f"--service-account-private-key-file={certs / 'sa.key'}",
            f"--root-ca-file={certs / 'ca.crt'}",
            # Fake nodes send no heartbeats; nothing should evict their pods.
            "--controllers=*,-node-lifecycle-controller,-node-ipam-controller",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}", "--v=1"])
        self._start("kube-scheduler", [
            str(binary("kube-scheduler")), f"--kubeconfig={cm}", "--leader-elect=false",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}", "--v=1"])
        for i in range(self.num_nodes):
            self.add_node(f"e2e-node-{i}")
        self.wait_default_service_account()
        self.timings["cluster_ready_s"] = time.monotonic() - t0
        return self

    def kubectl(self, *args: str, check: bool = True, input: str | None = None):
        return subprocess.run(["kubectl", f"--kubeconfig={self.kubeconfig}", *args],
                              check=check, capture_output=True, text=True, input=input)

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    log = (self.dir / f"{name}.log").read_text()[-3000:]
                    raise RuntimeError(f"{name} exited ({p.returncode}):\n{log}")
            if self.kubectl("get", "--raw", "/readyz", check=False).returncode == 0:
                return
            time.sleep(0.5)
        raise TimeoutError("kube-apiserver did not become ready")

    def wait_default_service_account(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0:
                return
            time.sleep(0.5)
        raise TimeoutError("the controller-manager did not create the default ServiceAccount")

    def add_node(self, name: str) -> None:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
            "llmserve.io/e2e-node": "true"}}}
        self.kubectl("apply", "-f", "-", input=json.dumps(node))
        capacity = {"cpu": "64", "memory": "256Gi", "pods": "110"}
        status = {"status": {"capacity": capacity, "allocatable": capacity,
                             "addresses": [{"type": "InternalIP", "address": BRIDGE_IP}],
                             "conditions": [{"type": "Ready", "status": "True",
                                             "reason": "E2EPodRunner",
                                             "message": "processes stand in for containers"}]}}
        self.kubectl("patch", "node", name, "--subresource=status", "--type=merge",
                     "-p", json.dumps(status))
        # The API server taints new nodes not-ready; the node lifecycle controller, which
        # would lift it, is off (fake nodes send no heartbeats), so lift it here.
        self.kubectl("patch", "node", name, "--type=merge", "-p", '{"spec": {"taints": null}}')

    def down(self) -> None:
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        self.procs.clear()
        remove_network()


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] != "up":
        print(__doc__)
        return 2
    cluster = Cluster(Path(sys.argv[2]) if len(sys.argv) > 2 else None).up()
    print(f"cluster up in {cluster.timings['cluster_ready_s']:.1f} s\n"
          f"export KUBECONFIG={cluster.kubeconfig}", flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
