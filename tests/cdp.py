"""A real headless Chromium driven over the DevTools protocol with aiohttp's websocket
client: enough to load a page, evaluate JavaScript in it, collect what its console
reports and take a screenshot. (Playwright would download its own browser from a CDN;
this uses Debian's ``chromium``.)"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


class Chromium:
    """``async with Chromium(binary) as page``: one headless browser with one tab.
    ``page.problems`` lists console errors and warnings, uncaught exceptions and the
    browser's own error log entries (failed loads), as text."""

    def __init__(self, binary: str, width: int = 1280, height: int = 1100):
        self.binary = binary
        self.size = (width, height)
        self.problems: list[str] = []
        self._profile = tempfile.TemporaryDirectory(prefix="chromium-", ignore_cleanup_errors=True)
        # (Chromium's helper processes may still be writing their profile files as the
        # directory goes: cleanup retries below, then leaves what it cannot remove.)
        self._proc: subprocess.Popen | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task | None = None
        self._next_id = 0
        self._pending: dict[int, asyncio.Future] = {}
        self._loaded = asyncio.Event()

    async def __aenter__(self) -> Chromium:
        profile = Path(self._profile.name)
        self._proc = subprocess.Popen(
            [self.binary, "--headless=new", "--remote-debugging-port=0",
             f"--user-data-dir={profile}", "--no-sandbox",  # root, in a container
             "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions",
             f"--window-size={self.size[0]},{self.size[1]}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # its helpers in its process group: ended with it
        port = await self._devtools_port(profile / "DevToolsActivePort")
        self._session = aiohttp.ClientSession()
        async with self._session.get(f"http://127.0.0.1:{port}/json/list") as r:
            pages = [t for t in await r.json() if t["type"] == "page"]
        self._ws = await self._session.ws_connect(pages[0]["webSocketDebuggerUrl"],
                                                  max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        for domain in ("Page", "Runtime", "Log"):
            await self.send(f"{domain}.enable")
        return self

    async def __aexit__(self, *exc) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        if self._proc is not None:
            self._signal_group(signal.SIGTERM)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._signal_group(signal.SIGKILL)  # helpers that outlived the browser
        for _ in range(20):  # a helper's last write may land while the tree goes
            try:
                shutil.rmtree(self._profile.name)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
        self._profile.cleanup()  # marks it done (and removes nothing left: ignored)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    async def _devtools_port(self, path: Path, timeout: float = 60.0) -> int:
        """The port Chromium chose, from the file it writes once it listens."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self._proc.returncode}")
            lines = path.read_text().splitlines() if path.exists() else []
            if len(lines) >= 2:  # port, then the browser's websocket path
                return int(lines[0])
            await asyncio.sleep(0.1)
        raise TimeoutError("chromium did not open its DevTools port")

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            message = json.loads(msg.data)
            if "id" in message:
                future = self._pending.pop(message["id"], None)
                if future is not None and not future.done():
                    future.set_result(message)
            else:
                self._event(message["method"], message.get("params", {}))

    def _event(self, method: str, params: dict) -> None:
        if method == "Page.loadEventFired":
            self._loaded.set()
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "warning",
                                                                         "assert"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in
                            params.get("args", []))
            self.problems.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            self.problems.append(f"exception: {text}")
        elif method == "Log.entryAdded" and params["entry"]["level"] in ("error", "warning"):
            entry = params["entry"]
            self.problems.append(f"log {entry['level']}: {entry['text']} {entry.get('url', '')}")

    async def send(self, method: str, **params) -> dict:
        self._next_id += 1
        future = asyncio.get_running_loop().create_future()
        self._pending[self._next_id] = future
        await self._ws.send_json({"id": self._next_id, "method": method, "params": params})
        message = await asyncio.wait_for(future, 60)
        if "error" in message:
            raise RuntimeError(f"{method}: {message['error']}")
        return message["result"]

    async def navigate(self, url: str) -> None:
        """Open ``url`` and wait for its load event."""
        self._loaded.clear()
        await self.send("Page.navigate", url=url)
        await asyncio.wait_for(self._loaded.wait(), 60)

    async def evaluate(self, expression: str):
        """The expression's value (awaited when it is a promise), as JSON."""
        result = await self.send("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self) -> bytes:
        """The whole page (beyond the viewport too) as a PNG."""
        size = (await self.send("Page.getLayoutMetrics"))["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = await self.send("Page.captureScreenshot", format="png", clip=clip,
                               captureBeyondViewport=True)
        return base64.b64decode(shot["data"])
