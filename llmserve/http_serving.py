"""What the engine server and the gateway share: OpenAI-shaped error responses for
aiohttp's own exceptions, read timeouts against slow clients, and serving until
SIGTERM with a drain.

Slow clients (slow-loris): a connection that has not sent a complete request head
within ``header_timeout`` seconds of connecting (or of its previous response) is
closed; a request body not received within ``body_timeout`` seconds is answered 408
and the connection closed. Neither holds a handler, an engine slot or KV memory
while it dribbles in: the body is read before any request is queued."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable

from aiohttp import web

from llmserve.errors import APIError

HEADER_TIMEOUT = 30.0
BODY_TIMEOUT = 30.0
DRAIN_TIMEOUT = 30.0  # seconds in-flight requests may take after SIGTERM


def read_body_middleware(seconds: float):
    """Read the whole request body within ``seconds`` before the handler runs (the
    handler's own ``request.read()`` then returns it at once); else 408 and close.
    A JSON body nested deeper than the parser's recursion limit is a 400 here, not a
    RecursionError (a 500) in the handler."""
    @web.middleware
    async def read_body(request: web.Request, handler):
        if request.body_exists:
            try:
                body = await asyncio.wait_for(request.read(), seconds)
            except ConnectionResetError as e:
                # The client left mid-body: nobody to answer, the handler is being
                # cancelled (handler_cancellation) anyway; not a server error to log.
                raise asyncio.CancelledError from e
            except asyncio.TimeoutError:
                err = APIError(408, f"the request body did not arrive within {seconds:g} s",
                               code="request_timeout")
                return await answer_and_close(request, err)
            if too_deep(body):
                raise APIError(400, "the JSON body is nested too deeply")
        return await handler(request)
    return read_body


MAX_JSON_DEPTH = 256  # a count of brackets below which no body can be too deep


def too_deep(body: bytes) -> bool:
    """Whether parsing ``body`` as JSON would exceed Python's recursion limit. Bodies
    with few brackets (nearly all) pass on a count alone; others are parsed once more
    here (C speed), which is cheaper than a byte loop in Python."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return False
    try:
        json.loads(body)
    except RecursionError:
        return True
    except ValueError:  # bad JSON or UTF-8: the handler says so
        pass
    return False


async def answer_and_close(request: web.Request, err: APIError) -> web.StreamResponse:
    """Send ``err`` and close the connection at once (no lingering read of a body
    that a slow client is still dribbling in)."""
    body = json.dumps(err.body()).encode()
    resp = web.StreamResponse(status=err.status, headers={
        "Content-Type": "application/json", "Connection": "close"})
    resp.content_length = len(body)
    resp.force_close()
    await resp.prepare(request)
    await resp.write(body)
    await resp.write_eof()
    if request.transport is not None:
        request.transport.close()
    return resp


def http_error_response(e: web.HTTPException) -> web.Response:
    """aiohttp's 404/405/413/... as OpenAI-shaped errors (never an HTML page)."""
    if e.status == 413:
        err = APIError(413, f"request body too large: {e.text}", code="request_too_large")
    else:
        type_ = "not_found_error" if e.status == 404 else "invalid_request_error"
        err = APIError(e.status, e.reason, type_)
    return web.json_response(err.body(), status=e.status)


def runner_options(header_timeout: float = HEADER_TIMEOUT) -> dict:
    """How both servers run their aiohttp app (also what tests give TestServer)."""
    return dict(handler_cancellation=True, access_log=None, keepalive_timeout=header_timeout)


async def serve_until_signal(app: web.Application, host: str, port: int, *,
                             start_draining: Callable[[], None],
                             in_flight: Callable[[], int], drain_timeout: float,
                             ready: asyncio.Event | None = None,
                             header_timeout: float = HEADER_TIMEOUT,
                             stop: asyncio.Event | None = None) -> None:
    """Serve ``app``; on SIGTERM/SIGINT (or when ``stop`` is set) stop admitting
    (``start_draining``), wait up to ``drain_timeout`` seconds for in-flight requests,
    then close. An idle connection, or one whose request head is still incomplete, is
    closed after ``header_timeout`` seconds (aiohttp's keep-alive timer, which also runs
    from the connection's start). It stays above the clients' own keep-alive (aiohttp's
    15 s), so a pooled connection is never closed under a request the gateway is
    sending."""
    runner = web.AppRunner(app, **runner_options(header_timeout))
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
