"""The served model's memory under bodies it refuses (60 MB, deeply nested), and answers as before after.

The served model's memory under bodies it refuses: `monim serve-model`'s resident memory (the
server's process tree, sampled every 20 ms for the peak) before and after `--times` of each: a
60 MB JSON body of rows sent with Content-Length and chunked, `[` 200,000 deep and `{"a":` 50,000
deep; then a normal request, which must be answered as before the refusals.
Usage: monim bench serve-limits [--workdir monim-demo] (made with `monim run` when missing)
"""

from benchmarks.harness import MONIM, REPO, parser, save
import json
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from servers import client


def send(port: int, headers: dict, chunks: list[bytes]) -> tuple:
    """POST /invocations chunk by chunk: (status, answer's start), or (None, why) where none came."""
    try:
        status, answer = client.send(port, "POST", "/invocations", headers, chunks)
        return status, answer[:200].decode(errors="replace")
    except OSError as e:
        return None, repr(e)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "serve-limits")
    ap.add_argument("--workdir", type=Path, default=REPO / "monim-demo")
    ap.add_argument("--port", type=int, default=5056)
    ap.add_argument("--times", type=int, default=10)
    args = ap.parse_args(argv)
    if not (args.workdir / "mlflow.db").exists():
        subprocess.run([MONIM, "run", "--workdir", str(args.workdir)], check=True)
    server = subprocess.Popen([MONIM, "serve-model", "--workdir", str(args.workdir), "--port", str(args.port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{args.port}/ping", timeout=2)
                break
            except OSError:
                assert server.poll() is None, "the server did not start"
                time.sleep(0.5)
        tree = psutil.Process(server.pid)
        peak, stop = [0.0], threading.Event()

        def rss() -> float:
            return sum(p.memory_info().rss for p in [tree, *tree.children(recursive=True)]) / 2**20

        def sample() -> None:
            while not stop.wait(0.02):
                peak[0] = max(peak[0], rss())

        threading.Thread(target=sample, daemon=True).start()
        big = json.dumps({"dataframe_records": [{"text": "word " * 100}] * 118_000}).encode()
        parts = [big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)]
        normal = json.dumps({"dataframe_records": [{"text": "Oil prices rose on Monday after the meeting."}]}).encode()
        cases = {f"{len(big) / 1e6:.0f} MB JSON, Content-Length": ({"Content-Length": str(len(big))}, parts),
                 f"{len(big) / 1e6:.0f} MB JSON, chunked": ({"Transfer-Encoding": "chunked"},
                                                            [b"%x\r\n%s\r\n" % (len(p), p) for p in parts] + [b"0\r\n\r\n"]),
                 "[ x 200,000": ({"Content-Length": "200000"}, [b"[" * 200_000]),
                 '{"a": x 50,000': ({"Content-Length": "250000"}, [b'{"a":' * 50_000])}
        first = send(args.port, {"Content-Length": str(len(normal))}, [normal])
        time.sleep(1)
        result = {"rss_before_mib": rss(), "cases": []}
        print(f"RSS before: {result['rss_before_mib']:.0f} MiB")
        for name, (headers, chunks) in cases.items():
            peak[0] = 0.0
            for _ in range(args.times):
                status, answer = send(args.port, headers, chunks)
            time.sleep(1)
            result["cases"].append({"body": name, "times": args.times, "status": status, "answer": answer,
                                    "rss_after_mib": rss(), "rss_peak_mib": peak[0]})
            print(f"{name} x{args.times}: {status} {answer[:100]!r}; RSS after {rss():.0f} MiB (peak {peak[0]:.0f})")
        last = send(args.port, {"Content-Length": str(len(normal))}, [normal])
        result |= {"rss_after_mib": rss(), "answered_as_before": last == first}
        print(f"RSS after all: {rss():.0f} MiB; a normal request answered as before: {last == first}")
        stop.set()
        save(args.out, result, args)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
