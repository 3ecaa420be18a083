"""The documentation site as a reader uses it: headless Chromium (Debian's ``chromium``, which .ci/run installs)
opens the strictly built site, searches for a job-file field through Material's own search box (its client-side
index, built by the site's search plugin, queried in its web worker) and follows the first result to the field's
entry in the generated job-file reference. Driven over the DevTools protocol (aiohttp's websocket client, which
Ray's dashboard already brings); the site is served on loopback only, as a reader's ``mkdocs serve`` would. No Ray."""

from __future__ import annotations

import asyncio
import functools
import http.server
import itertools
import json
import shutil
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.support.docs_site import build_site

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FIELD = "train.loss_chunks"  # a field the reference generates from the schema (no page names it in a heading)
ANCHOR = "trainloss_chunks"  # its heading's id: the toc extension's slug of `train.loss_chunks`


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The built site, served by a loopback HTTP server (the search worker fetches its index over HTTP)."""
    out = tmp_path_factory.mktemp("site") / "site"
    proc = build_site(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(out)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        """No line per request in the test's output."""


class Page:
    """One Chromium tab over the DevTools protocol: navigate, and evaluate JavaScript until it answers."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws, self.ids = ws, itertools.count(1)

    async def call(self, method: str, **params) -> dict:
        call_id = next(self.ids)
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        async for message in self.ws:
            reply = json.loads(message.data)
            if reply.get("id") == call_id:
                assert "error" not in reply, reply
                return reply["result"]
        raise AssertionError(f"the browser closed the connection during {method}")

    async def value(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 60):
        """``expression``'s value once it is truthy (the search worker answers asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                value = await self.value(expression)
            except AssertionError as exc:  # asked while a navigation replaced the page: ask the new one
                if "navigated" not in str(exc):
                    raise
                value = None
            if value:
                return value
            await asyncio.sleep(0.25)
        raise AssertionError(f"{expression} stayed empty for {timeout_s} s")


async def _page_socket(session: aiohttp.ClientSession, profile: Path) -> str:
    """The first tab's DevTools websocket URL, once Chromium has written its port into the profile."""
    port_file = profile / "DevToolsActivePort"
    for _ in range(240):
        if port_file.exists() and port_file.read_text().strip():
            break
        await asyncio.sleep(0.25)
    port = port_file.read_text().split()[0]
    async with session.get(f"http://127.0.0.1:{port}/json/list") as reply:
        targets = await reply.json()
    return next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")


LANDED = f"""location.hash === '#{ANCHOR}' && document.readyState === 'complete' && (() => {{
    const entry = document.getElementById('{ANCHOR}');
    return entry && {{url: location.href, tag: entry.tagName, text: entry.textContent}};
}})()"""


async def _search(page: Page, base: str, query: str) -> list[str]:
    """Open the site, type ``query`` into its search box as a reader would, and return the results' links."""
    await page.call("Page.navigate", url=f"{base}/")
    await page.wait_for("document.readyState === 'complete' && !!document.querySelector('.md-search__input')")
    await page.value(f"""(() => {{
        const box = document.querySelector('.md-search__input');
        document.querySelector('#__search').checked = true;
        box.focus(); box.value = {json.dumps(query)};
        box.dispatchEvent(new Event('input', {{bubbles: true}}));
        box.dispatchEvent(new KeyboardEvent('keyup', {{bubbles: true}}));
    }})()""")
    return await page.wait_for("[...document.querySelectorAll('.md-search-result__item a')].map(a => a.href)")


async def search_and_follow(base: str, query: str, profile: Path) -> dict:
    """Search for ``query``, click the first entry it finds; where did it land?"""
    browser = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
                                "--remote-debugging-address=127.0.0.1", f"--user-data-dir={profile}", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async with aiohttp.ClientSession() as session, \
                session.ws_connect(await _page_socket(session, profile), max_msg_size=0) as ws:
            page = Page(ws)
            results = await _search(page, base, query)
            # Material lists the best page first, then its matching sections: click the first section (an entry,
            # with its anchor), after this evaluation returns (the navigation would cut its reply off)
            await page.value("setTimeout(() => [...document.querySelectorAll('.md-search-result__item a')]"
                             ".find(a => a.hash).click(), 0)")
            return {"results": results, **await page.wait_for(LANDED)}
    finally:
        browser.kill()
        browser.wait(timeout=30)


def test_searching_a_field_lands_on_its_entry_in_the_job_file_reference(site, tmp_path):
    assert Path(CHROMIUM).exists(), "headless Chromium is needed: apt-get install chromium (as .ci/run does)"
    found = asyncio.run(asyncio.wait_for(search_and_follow(site, FIELD, tmp_path / "profile"), timeout=180))
    page, entry = urlsplit(found["results"][0]), urlsplit(next(url for url in found["results"] if "#" in url))
    assert page.path == "/reference/job-file/", found["results"][:5]  # the best page: the reference
    assert (entry.path, entry.fragment) == ("/reference/job-file/", ANCHOR), found["results"][:5]
    landed = urlsplit(found["url"])
    assert (landed.path, landed.fragment) == ("/reference/job-file/", ANCHOR)
    assert found["tag"] == "H3" and FIELD in found["text"]
