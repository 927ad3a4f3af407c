"""What the engine server and the gateway share: OpenAI-shaped error responses for
aiohttp's own exceptions, and serving until SIGTERM with a drain."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

from aiohttp import web

from llmserve.errors import APIError


def http_error_response(e: web.HTTPException) -> web.Response:
    """aiohttp's 404/405/413/... as OpenAI-shaped errors (never an HTML page)."""
    if e.status == 413:
        err = APIError(413, f"request body too large: {e.text}", code="request_too_large")
    else:
        type_ = "not_found_error" if e.status == 404 else "invalid_request_error"
        err = APIError(e.status, e.reason, type_)
    return web.json_response(err.body(), status=e.status)


async def serve_until_signal(app: web.Application, host: str, port: int, *,
                             start_draining: Callable[[], None],
                             in_flight: Callable[[], int], drain_timeout: float,
                             ready: asyncio.Event | None = None,
                             stop: asyncio.Event | None = None) -> None:
    """Serve ``app``; on SIGTERM/SIGINT (or when ``stop`` is set) stop admitting
    (``start_draining``), wait up to ``drain_timeout`` seconds for in-flight requests,
    then close."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    start_draining()
    deadline = loop.time() + drain_timeout
    while in_flight() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await runner.cleanup()
