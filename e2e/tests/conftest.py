"""A real control plane for the whole e2e session, plus the pod runner."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from e2e.cluster import Cluster
from e2e.podrunner import PodRunner

ROOT = Path(__file__).resolve().parents[2]


class RunnerThread(threading.Thread):
    def __init__(self, runner: PodRunner):
        super().__init__(daemon=True, name="podrunner")
        self.runner = runner
        self.loop = asyncio.new_event_loop()

    def run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.task = self.loop.create_task(self.runner.run())
        try:
            self.loop.run_until_complete(self.task)
        except asyncio.CancelledError:
            pass

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.join(timeout=60)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    t0 = time.monotonic()
    c = Cluster(tmp_path_factory.mktemp("cluster")).up()
    from llmserve.envs import cache_root
    from llmserve.model_executor.model_loader.sources import resolve_model
    resolve_model("smollm2-135m-instruct")  # warm the "image's" model cache once
    os.environ["LLMSERVE_CACHE"] = str(cache_root())
    # Pod directories live outside /tmp: a pod's emptyDir mounted at /tmp must not
    # hide the sources of its other mounts.
    pods_dir = Path(tempfile.mkdtemp(prefix="llmserve-e2e-pods-", dir="/var/tmp"))
    runner = PodRunner(c.kubeconfig, c.server, c.dir / "certs" / "ca.crt", pods_dir)
    thread = RunnerThread(runner)
    thread.start()
    c.runner = runner
    global _RUNNER
    _RUNNER = runner
    print(f"\n[e2e] control plane ready in {time.monotonic() - t0:.1f} s "
          f"({json.dumps(c.timings)})", file=sys.stderr)
    yield c
    thread.stop()
    c.down()


@pytest.fixture(scope="session")
def kubectl(cluster):
    def run(*args, check=True, input=None):
        r = cluster.kubectl(*args, check=False, input=input)
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{r.stderr}")
        return r
    return run


def wait_for(predicate, timeout=120.0, interval=0.5, what="condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def get_json(kubectl, *args):
    return json.loads(kubectl("get", *args, "-o", "json").stdout)


@pytest.fixture(scope="session")
def crd(kubectl):
    # --force-conflicts: helm may have installed the same CRD earlier in the session.
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    wait_for(lambda: kubectl("get", "llmd", check=False).returncode == 0, 60, what="CRD")


class OperatorProcess:
    """`llmserve operator` run as a local process with the admin kubeconfig."""

    def __init__(self, cluster, namespace: str):
        self.args = [sys.executable, "-m", "llmserve", "operator", "--namespace", namespace,
                     "--health-port", "0"]
        self.env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
        self.env.pop("KUBERNETES_SERVICE_HOST", None)
        self.log = cluster.dir / f"operator-{namespace}.log"
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=open(self.log, "a"),
                                     stderr=subprocess.STDOUT)
        return self

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


_RUNNER: PodRunner | None = None  # set by the cluster fixture, read by the failure report

# The files that take longest, collected first. `make test` runs the e2e suite in two
# pytest-xdist workers, each with a cluster of its own (e2e/cluster.py's network
# slots), handing out whole files in collection order (--dist loadfile
# --no-loadscope-reorder): the long file starts at once and short ones fill the end.
LONGEST_FIRST = ("test_e2e.py", "test_pd_e2e.py", "test_chaos_e2e.py",
                 "test_operator_api.py", "test_lora_e2e.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failure, attach what the pods said: the last lines of every pod's log (the
    operator, gateways, engines), which the session's temporary folders do not keep."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed or _RUNNER is None:
        return
    logs = sorted(_RUNNER.workdir.glob("pods/*/container.log"), key=lambda p: p.stat().st_mtime)
    names = {str(p.dir): f"{p.namespace}/{p.name} (restarts {p.restarts})"
             for p in list(_RUNNER.pods.values())}
    sections = []
    for log in logs[-12:]:
        lines = log.read_text(errors="replace").splitlines()[-25:]
        sections.append(f"--- {names.get(str(log.parent), log.parent.name)}\n" + "\n".join(lines))
    report.sections.append(("pod logs (last 25 lines of the 12 latest)", "\n".join(sections)))
