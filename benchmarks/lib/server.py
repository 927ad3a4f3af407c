"""Server processes a benchmark starts itself (a peer's server, ``llmserve up``,
Prometheus): waiting until they answer, stopping them, and asking what they serve.

``llmserve serve`` and ``llmserve gateway`` alone go through the product's own
``llmserve.entrypoints.launcher.ServerProcess``; this is for any other command line.
Standard library only: a client that never imports torch stays that way."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path


def poll(ready: Callable[[], bool], timeout: float, interval: float = 0.5) -> bool:
    """Call ``ready()`` every ``interval`` s until it is true (True) or ``timeout`` s
    have passed (False); an OSError (nothing listening yet) counts as not ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ready():
                return True
        except OSError:
            pass
        time.sleep(interval)
    return False


def wait_until(ready: Callable[[], bool], timeout: float, what: str) -> None:
    """``poll``, and exit the benchmark saying what never came up."""
    if not poll(ready, timeout):
        raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def get_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def served_model(url: str) -> str:
    """The first model id an OpenAI-compatible server lists at /v1/models."""
    return get_json(url + "/v1/models")["data"][0]["id"]


def start_server(cmd: list[str], port: int, log_path: Path, name: str,
                 timeout: float = 600.0) -> subprocess.Popen:
    """Start ``cmd`` (its output to ``log_path``, in a session of its own) and wait
    until it answers 200 on 127.0.0.1:``port``/health (llama-server answers 503 while
    it loads the model; llmserve only listens once it is warmed up)."""
    log = open(log_path, "w")  # closed with the process, in stop_server
    # cwd: not the repository root, where `python -m` would put the working tree's
    # llmserve ahead of PYTHONPATH (which may point at another checkout, e.g. a baseline)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            cwd=log_path.parent, start_new_session=True)
    proc.log = log  # type: ignore[attr-defined]

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; see {log_path}")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200

    if poll(healthy, timeout):
        return proc
    stop_server(proc)
    raise TimeoutError(f"{name} not healthy after {timeout:.0f} s; see {log_path}")


def stop_server(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 60) -> None:
    """Send ``sig``, wait ``grace`` s, then kill; close the log ``start_server`` opened."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log = getattr(proc, "log", None)
    if log is not None:
        log.close()
