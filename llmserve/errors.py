"""OpenAI-shaped API errors, shared by the engine server and the gateway (which must
not pay for importing the engine: no torch here)."""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)
        self.headers = headers or {}  # e.g. Retry-After on 429 and 503

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, None)


class ModelLoadError(Exception):
    """A checkpoint that cannot be used; the message is one line for the user."""


class EngineStartError(RuntimeError):
    """The engine was built but could not run a step (e.g. a kernel did not compile)."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running (it failed or was shut down)."""


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited; the engine cannot run another step."""
