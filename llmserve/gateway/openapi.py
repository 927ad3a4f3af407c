"""The gateway's /openapi.json: an engine's own document, cut to the operations the
gateway serves (what clients generate code from and what the gateway's fuzz test
sends). It is fetched from a live engine, not built here: the gateway runs without
the engine's code (no torch, no pydantic models), and the document it serves is then
the one of the engines it fronts, whatever their version (vLLM's too)."""

from __future__ import annotations

import asyncio

import aiohttp

from llmserve.errors import APIError

GATEWAY_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models",
                 "/health")
FETCH_TIMEOUT = 5.0  # per engine asked; the document is small and built at start


class UpstreamOpenAPI:
    """The first document an engine gives, cut and kept for the gateway's lifetime (the
    engines behind one gateway serve one model with one API)."""

    def __init__(self):
        self.doc: dict | None = None
        self._lock = asyncio.Lock()  # one fetch at a time, however many clients ask

    async def get(self, session: aiohttp.ClientSession, urls: list[str]) -> dict:
        """Raises a 503 APIError when no engine in ``urls`` gives a document."""
        async with self._lock:
            if self.doc is None:
                self.doc = cut_to_gateway(await fetch_first(session, urls))
        return self.doc


async def fetch_first(session: aiohttp.ClientSession, urls: list[str]) -> dict:
    errors = []
    for url in urls:
        try:
            async with session.get(url + "/openapi.json",
                                   timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT)) as r:
                if r.status != 200:
                    errors.append(f"{url}: HTTP {r.status}")
                    continue
                doc = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            errors.append(f"{url}: {e!r}")
            continue
        if isinstance(doc, dict) and isinstance(doc.get("paths"), dict):
            return doc
        errors.append(f"{url}: not an OpenAPI document")
    raise APIError(503, "no engine gave its OpenAPI document: "
                   + ("; ".join(errors) or "no endpoint is available"), "service_unavailable")


def cut_to_gateway(doc: dict) -> dict:
    return {**doc, "paths": {p: v for p, v in doc["paths"].items() if p in GATEWAY_PATHS},
            "info": {**doc.get("info", {}), "title": "llmserve gateway"}}
