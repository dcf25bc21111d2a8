"""A client of the served model (`monim serve-model`) on loopback: one request, its health, and many
callers asking at once (the load benchmarks' clients, and the tests')."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter


def post(port: int, body: dict | bytes, timeout: float = 300) -> tuple[int, dict]:
    """POST a body to /invocations: (HTTP status, the JSON answer)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def send(port: int, method: str, path: str, headers: dict, chunks=(), timeout: float = 300) -> tuple[int, bytes]:
    """A raw request, its body sent chunk by chunk as given (the server may answer and close before the
    whole body is sent): (HTTP status, the answer's bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.putrequest(method, path)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        try:
            for chunk in chunks:
                conn.send(chunk)
        except OSError:  # answered and closed before the whole body was sent
            pass
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def health(port: int, timeout: float = 30) -> dict:
    """GET /health: what is served, since when, the champion last seen."""
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout).read())


class Clients:
    """`n` clients sending the bodies (round robin) again and again until stopped; each answer kept
    with when it was asked."""

    def __init__(self, port: int, bodies: list[dict], n: int):
        self.asked: list[tuple[float, int | None, dict]] = []  # (sent at, status, answer)
        self._stop = threading.Event()

        def ask(c: int) -> None:
            for i in range(c, 1 << 62, n):
                if self._stop.is_set():
                    return
                sent = time.monotonic()
                try:
                    status, out = post(port, bodies[i % len(bodies)])
                except OSError as e:  # no answer at all (reset, timeout): a failed request too
                    status, out = None, {"message": repr(e)}
                self.asked.append((sent, status, out))

        self._threads = [threading.Thread(target=ask, args=(c,)) for c in range(n)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def answered(self, since: float = 0.0) -> list[dict]:
        """The answers (200s) to requests sent after `since`."""
        return [out for sent, status, out in self.asked if sent > since and status == 200]

    def cited(self, since: float = 0.0) -> Counter:
        """Documents cited by the answers to requests sent after `since`, by how often."""
        return Counter(s["doc_id"] for out in self.answered(since) for p in out["predictions"]
                       for sentence in p.get("sentences", ()) for s in sentence["sources"])

