"""Headless Chromium driven over the Chrome DevTools Protocol, for tests of pages people read.

No Playwright or Selenium: Debian's ``chromium`` (installed by the README's test command), its
``--remote-debugging-port``, and aiohttp's websocket client. Enough of the protocol to load a
page, read what it shows (``Runtime.evaluate``), size the window like a phone and take a
screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
INSTALL = "apt-get install -y chromium (the README's test command does)"


def chromium_path() -> str:
    """The browser, or fail the test (not skip): the README's test command installs it."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path is not None:
            return path
    pytest.fail(f"headless Chromium is needed for this test and none was found: {INSTALL}")


class Browser:
    """One headless Chromium process and one page in it."""

    def __init__(self, process: subprocess.Popen[bytes], http: aiohttp.ClientSession) -> None:
        self._process = process
        self._http = http
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._events: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None

    @classmethod
    async def launch(cls, profile: Path, timeout_s: float = 30.0) -> Browser:
        profile.mkdir(parents=True, exist_ok=True)
        process = subprocess.Popen(
            [
                chromium_path(),
                "--headless=new",
                "--remote-debugging-port=0",  # it picks a free port and writes it down
                f"--user-data-dir={profile}",
                "--no-sandbox",  # tests may run as root (CI containers)
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--hide-scrollbars",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its helper processes go with it on close
        )
        http = aiohttp.ClientSession()
        browser = cls(process, http)
        try:
            await browser._attach(profile / "DevToolsActivePort", timeout_s)
        except BaseException:
            await browser.close()
            raise
        return browser

    async def _attach(self, port_file: Path, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pages: list[dict[str, Any]] = []
        while not pages:
            if self._process.poll() is not None:
                raise RuntimeError(f"chromium exited with {self._process.returncode}")
            if loop.time() > deadline:
                raise TimeoutError(f"chromium gave no DevTools page within {timeout_s}s")
            with contextlib.suppress(OSError, ValueError, IndexError, aiohttp.ClientError):
                port = int(port_file.read_text().split()[0])
                async with self._http.get(f"http://127.0.0.1:{port}/json/list") as resp:
                    pages = [t for t in await resp.json() if t.get("type") == "page"]
            if not pages:
                await asyncio.sleep(0.1)
        self._ws = await self._http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        await self.send("Page.enable")
        await self.send("Runtime.enable")

    async def _read(self) -> None:
        assert self._ws is not None
        async for message in self._ws:
            if message.type is not aiohttp.WSMsgType.TEXT:
                break
            data = message.json()
            future = self._waiting.pop(data.get("id", -1), None)
            if future is not None and not future.done():
                future.set_result(data)
            elif "method" in data:
                self._queue(data["method"]).put_nowait(data.get("params", {}))
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(ConnectionError("chromium closed the DevTools connection"))

    def _queue(self, method: str) -> asyncio.Queue[dict[str, Any]]:
        return self._events.setdefault(method, asyncio.Queue())

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result, or an AssertionError with the browser's error."""
        assert self._ws is not None
        call_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        await self._ws.send_json({"id": call_id, "method": method, "params": params})
        async with asyncio.timeout(30):
            answer = await future
        if "error" in answer:
            raise AssertionError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    async def goto(self, url: str, timeout_s: float = 15.0, *, wait_load: bool = True) -> None:
        """Load ``url`` and wait for its load event (not with ``wait_load=False``: a page that
        opens a dialog at once may never fire it until the dialog is answered)."""
        loaded = self._queue("Page.loadEventFired")
        while not loaded.empty():
            loaded.get_nowait()
        result = await self.send("Page.navigate", url=url)
        if result.get("errorText"):
            raise AssertionError(f"loading {url}: {result['errorText']}")
        if wait_load:
            async with asyncio.timeout(timeout_s):
                await loaded.get()

    async def answer_dialog(self, text: str, timeout_s: float = 10.0) -> str:
        """Wait for the page's next alert, confirm or prompt, type ``text`` and press OK; the
        dialog's message."""
        async with asyncio.timeout(timeout_s):
            dialog = await self._queue("Page.javascriptDialogOpening").get()
        await self.send("Page.handleJavaScriptDialog", accept=True, promptText=text)
        return str(dialog.get("message", ""))

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 10.0, what: str = "") -> Any:
        """Poll a JavaScript expression until it is truthy; its value. Fails with ``what``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if loop.time() > deadline:
                raise AssertionError(
                    f"timed out after {timeout_s}s waiting for {what or expression} (last: {value!r})"
                )
            await asyncio.sleep(0.1)

    async def viewport(self, width: int, height: int, *, mobile: bool = False) -> None:
        """Size the page as a laptop window, or a phone's screen (``mobile``)."""
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=mobile,
        )

    async def screenshot(self, path: Path, *, full_page: bool = False) -> Path:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
            size = await self.evaluate(
                "[document.documentElement.scrollWidth, document.documentElement.scrollHeight]"
            )
            params["clip"] = {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1}
        data = (await self.send("Page.captureScreenshot", **params))["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        await self._http.close()
        if self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGTERM)  # the group this launch started
            try:
                await asyncio.to_thread(self._process.wait, 10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._process.pid, signal.SIGKILL)
                await asyncio.to_thread(self._process.wait)
