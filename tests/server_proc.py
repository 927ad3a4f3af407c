"""Start real `llmserve serve` processes on loopback addresses for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import closing


def free_port(host: str) -> int:
    with closing(socket.socket()) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, host: str = "127.0.0.2", extra: list[str] | None = None,
                 env: dict | None = None):
        self.host, self.port = host, free_port(host)
        cmd = [sys.executable, "-m", "llmserve.cli", "serve", "--model", model,
               "--host", host, "--port", str(self.port), "--kv-cache-memory", str(64 << 20),
               "--log-level", "WARNING", *(extra or [])]
        self.log = open(os.devnull, "w") if os.environ.get("QUIET") else None
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
        self.wait_ready()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not become healthy")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (and bare names summed over labels)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
        name = key.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + float(value) if name != key else float(value)
    return out
