"""The client side of a streamed OpenAI API response (server-sent events).

Each script decides what an event means to it (a token, a chunk of text, usage); what
they share is reading the stream: the JSON ``data:`` lines, each stamped when it
arrived, and whether the stream ended with ``[DONE]``."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator


class EventStream:
    """``async for arrived, event in EventStream(response)``: every JSON event of an
    aiohttp response, with its ``time.perf_counter()`` arrival, read to the end of the
    body (a connection read to its end goes back to the pool). ``done`` turns true when
    the server sent ``data: [DONE]``."""

    def __init__(self, response):
        self.response = response
        self.done = False

    async def __aiter__(self) -> AsyncIterator[tuple[float, dict]]:
        async for line in self.response.content:
            if not line.startswith(b"data: "):
                continue
            arrived = time.perf_counter()
            data = line[6:].strip()
            if data == b"[DONE]":
                self.done = True
            elif data.startswith(b"{"):
                yield arrived, json.loads(data)
