"""Start and stop llmserve processes on this machine (used by `llmserve up`,
the benchmarks and the tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

from llmserve.utils import free_port


class ServerProcess:
    """``python -m llmserve <args>`` serving on host:port, ready once /health is 200."""

    def __init__(self, args: list[str], host: str, port: int | None = None,
                 env: dict | None = None, stdout=None, ready_timeout: float = 180.0):
        self.host, self.port = host, port or free_port(host)
        cmd = [sys.executable, "-m", "llmserve", *args, "--host", host,
               "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=stdout,
                                     stderr=subprocess.STDOUT if stdout else None)
        self.wait_ready(ready_timeout)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url}: process exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.url} did not become healthy in {timeout:.0f} s")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def scrape_metrics(url: str, timeout: float = 5.0) -> dict[str, float]:
    """Prometheus text of ``url``/metrics -> {'name{labels}': value}, plus each bare
    name summed over its label sets."""
    from llmserve.metrics_scrape import by_series
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        return by_series(r.read().decode())
