"""Routing for /v1/responses: its prefix key, and follow-ups pinned to their engine.

A stored response lives in the memory of the engine that made it, so a request with
``previous_response_id`` can only be served there. The engine names each response it
stored in the header ``x-llmserve-response-id``; the gateway keeps a bounded map from
those ids to the endpoint that answered and sends follow-ups there while it is in the
pool. When it is gone (or the id is unknown here: another gateway replica, or evicted
from the map) the request is routed as any other and the engine that gets it answers
404 ``previous_response_not_found``, as OpenAI does for an unknown id.
"""

from __future__ import annotations

from collections import OrderedDict

from llmserve.gateway.prefix import prefix_key

RESPONSES_PATH = "/v1/responses"
RESPONSE_ID_HEADER = "x-llmserve-response-id"  # set by entrypoints/openai/serving_responses.py
MAX_PINNED = 100_000  # ids remembered; ~100 bytes each


class ResponseAffinity:
    def __init__(self, max_entries: int = MAX_PINNED):
        self.max_entries = max_entries
        self._urls: OrderedDict[str, str] = OrderedDict()  # least recently used first

    def remember(self, headers, url: str) -> None:
        """Note the endpoint of a stored response (from an engine's response headers)."""
        rid = headers.get(RESPONSE_ID_HEADER)
        if not rid:
            return
        self._urls[rid] = url
        self._urls.move_to_end(rid)
        while len(self._urls) > self.max_entries:
            self._urls.popitem(last=False)

    def endpoint_for(self, payload: dict) -> str | None:
        """The endpoint that stored the response this request continues, if known."""
        rid = payload.get("previous_response_id")
        url = self._urls.get(rid) if isinstance(rid, str) else None
        if url is not None:
            self._urls.move_to_end(rid)
        return url


def responses_key(payload: dict, max_chars: int) -> str:
    """The prefix key of a Responses request, as a chat request with its instructions
    as the system message and its input as the messages would have."""
    messages = []
    if isinstance(payload.get("instructions"), str):
        messages.append({"role": "system", "content": payload["instructions"]})
    given = payload.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):  # items without a role (function calls) are skipped
        messages += [{"role": m.get("role"), "content": m.get("content")}
                     for m in given if isinstance(m, dict)]
    return prefix_key({"model": payload.get("model"), "messages": messages}, max_chars)
