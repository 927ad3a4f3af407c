"""Real `llmserve serve` processes on loopback addresses for tests."""

from __future__ import annotations

from llmserve.entrypoints.launcher import ServerProcess as _Process
from llmserve.entrypoints.launcher import scrape_metrics as scrape  # noqa: F401 - re-exported for tests


class ServerProcess(_Process):
    def __init__(self, model: str, host: str = "127.0.0.2", extra: list[str] | None = None,
                 env: dict | None = None, port: int | None = None):
        super().__init__(["serve", "--model", model, "--kv-cache-memory", str(64 << 20),
                          "--log-level", "WARNING", *(extra or [])], host, port, env=env)
