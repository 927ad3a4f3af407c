"""Token usage of a proxied response, read as it passes through.

Rate limits and fair shares are charged an estimate when a request is admitted and
corrected from its real usage when it ends. A JSON response carries ``usage``; a
stream carries it in a final chunk only when asked (``stream_options.include_usage``),
so the gateway asks for it on every stream and, when the client did not, drops that
chunk on the way back: the client sees exactly what it asked for. A /v1/responses
stream always ends with the response, usage included (``response.completed``,
``response.incomplete`` or ``response.failed``), in events that start with an
``event:`` line; nothing is asked for and nothing is dropped there.
"""

from __future__ import annotations

import json
import time

MAX_JSON_BODY = 8 << 20  # a larger JSON body is passed through without reading usage


# The Responses stream's last events: their ``response`` carries the usage.
FINAL_RESPONSE_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def ask_for_usage(payload: dict, kind: str = "completions") -> bool:
    """Make a streaming request report usage. True if the client did not ask for it
    (its usage chunk must then be removed from the response)."""
    if not payload.get("stream") or kind == "responses":
        return False
    options = payload.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return False
    payload["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                 "include_usage": True}
    return True


class UsageTap:
    """Feed it the response's chunks; it returns what to send on and keeps the
    total tokens of the usage it saw (None if none)."""

    def __init__(self, stream: bool, drop_usage_chunk: bool):
        self.stream = stream
        self.drop_usage_chunk = drop_usage_chunk
        self.total_tokens: int | None = None
        self.first_byte_at: float | None = None  # for time to first token
        self._buffer = b""
        self._body: bytearray | None = None if stream else bytearray()

    def feed(self, chunk: bytes) -> bytes:
        if self.first_byte_at is None and chunk:
            self.first_byte_at = time.monotonic()
        if not self.stream:
            if self._body is not None:
                self._body += chunk
                if len(self._body) > MAX_JSON_BODY:
                    self._body = None
            return chunk
        self._buffer += chunk
        *events, self._buffer = self._buffer.split(b"\n\n")
        kept = [e for e in events if self._keep(e)]
        return b"".join(e + b"\n\n" for e in kept)

    def finish(self) -> bytes:
        """The end of the response: what is left to send."""
        if self._body is not None:
            self._read_usage(bytes(self._body))
        rest, self._buffer = self._buffer, b""
        return rest

    def _keep(self, event: bytes) -> bool:
        raw = _data_line(event) if b'"usage"' in event else None
        if raw is None:
            return True
        data = self._read_usage(raw)
        return not (self.drop_usage_chunk and data is not None and data.get("choices") == []
                    and data.get("usage") is not None)

    def _read_usage(self, raw: bytes) -> dict | None:
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(data, dict):
            return None
        usage = data.get("usage")
        if data.get("type") in FINAL_RESPONSE_EVENTS and isinstance(data.get("response"), dict):
            usage = data["response"].get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("total_tokens"), int):
            self.total_tokens = usage["total_tokens"]
        return data


def _data_line(event: bytes) -> bytes | None:
    """The JSON object of an SSE event: its ``data:`` line, after any ``event:`` line
    (the Responses API names each event; chat and completions do not)."""
    for line in event.split(b"\n"):
        if line.startswith(b"data: {"):
            return line[6:]
    return None
