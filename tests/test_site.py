"""The site works offline: its page with the architecture diagram, served from 127.0.0.1 and opened in
a headless Chromium, asks nothing of another host (no font or script server) and draws the diagram
with the Mermaid it ships."""

import functools
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest

from helpers import chromium

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # builds the site and starts Chromium


def test_the_diagram_is_drawn_and_no_request_leaves_the_machine(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "-d", str(site)], cwd=REPO,
                          env=os.environ | {"NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    outside: list[str] = []

    def only_here(route) -> None:
        url = urlparse(route.request.url)
        if url.scheme in ("data", "blob") or url.hostname == "127.0.0.1":
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    try:
        with chromium() as browser:
            page = browser.new_page()
            page.route("**/*", only_here)
            # Material draws the diagram into a closed shadow root: opened here, so that the test sees its <svg>
            page.add_init_script("const attach = Element.prototype.attachShadow; Element.prototype.attachShadow = "
                                 "function (init) { return attach.call(this, {...init, mode: 'open'}); };")
            for path in ("", "concepts/method/"):
                page.goto(f"http://127.0.0.1:{server.server_port}/{path}", wait_until="networkidle")
            page.locator(".mermaid svg").first.wait_for(timeout=60_000)
            drawn = page.locator(".mermaid svg").first.text_content()
    finally:
        server.shutdown()
    assert outside == []
    assert all(stage in drawn for stage in ("ingest", "featurize", "memorize", "register")), drawn
