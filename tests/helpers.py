"""What several test files do the same way (plain functions; the fixtures are tests/conftest.py's):
the demo's articles as a small feed or texts, `monim learn` and its refusals, a memory learned in process,
random datastore entries, exact nearest neighbours by numpy, requests sent at once, a headless Chromium."""

from __future__ import annotations

import datetime as dt
import gzip
import json
import re
import shutil
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from monim.core.config import DEMO_STREAM

# The exit status of a command that ends in one line on stderr (and a full disk: cli.errors.NO_ROOM):
REFUSED = 2  # refused before any work: bad input, a setting or range that cannot be (cli.errors.fail)
FAILED = 1  # failed while it ran: a damaged file or database met on the way (cli.guarded)


def refused(proc: subprocess.CompletedProcess, *says: str, status: int = REFUSED) -> None:
    """The command ended with exit status `status` (REFUSED, FAILED or NO_ROOM) and one line on stderr,
    `error: ...`, saying each of `says`; no traceback."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == status and len(errors) == 1 and "Traceback" not in proc.stderr, \
        (proc.returncode, proc.stderr[-3000:])
    assert all(s in errors[0] for s in says), errors[0]


def demo_rows(days: int = 3, per_day: int = 3) -> list[dict]:
    """The first `per_day` articles of each of the demo stream's first `days` days."""
    rows: list[dict] = []
    for line in gzip.open(DEMO_STREAM, "rt"):
        row = json.loads(line)
        if sum(r["date"] == row["date"] for r in rows) < per_day and len({r["date"] for r in rows} | {row["date"]}) <= days:
            rows.append(row)
    return rows


def demo_texts(n: int, chars: int = 600) -> list[str]:
    """The first `chars` characters of the demo's first n training articles of 1987-03-04 and 03-05."""
    from monim.data.feed import open_feed
    from monim.data.stream import iter_days

    days = iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 4), dt.date(1987, 3, 5))
    return [d.text[:chars] for d in [d for day in days for d in day.train][:n]]


def first_words(text: str, n: int) -> str:
    """The text up to the end of its n-th word, as written (its own spaces and line breaks)."""
    return text[: [m.end() for m in re.finditer(r"\S+", text)][n - 1]]


def words_continued(text: str, prompt: str, generated: str) -> int:
    """How many of the article's words after the prompt the generation writes before it leaves them."""
    want, got = text[len(prompt):].split(), generated.split()
    return next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))


def write_feed(path: Path, records: list) -> Path:
    """A feed file of these records, one a line: a dict as JSON, a str or bytes line as it is; gzipped
    where the name ends in .gz."""
    lines = [r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode() for r in records]
    data = b"".join(line + b"\n" for line in lines)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def learn(monim, source: Path, workdir: Path, model: Path, *more, check: bool = False,
          own_api: bool = False) -> subprocess.CompletedProcess:
    """`monim learn --policy fullmem` (every token stored: what these tests read back) of `source` into
    `workdir` with `model`; `check=False`: a refusal is the test's to read."""
    return monim("learn", "--source", source, "--workdir", workdir, "--model", model, "--policy", "fullmem", *more,
                 check=check, own_api=own_api)


def learned_memory(root: Path, lm, days, settings=None, policy: str = "fullmem", features=None):
    """A memory of these days as a day's run makes it in process: each day memorized under `policy`,
    then Θ calibrated on it (the LM's features from a store, or None: the LM itself)."""
    from monim.learning.calibration import calibrate
    from monim.learning.memorize import memorize_day
    from monim.learning.policies import make_policy
    from monim.theta.memory import Memory

    memory = Memory(root, lm, settings)
    for day in days:
        memorize_day(memory, day, make_policy(policy), features)
        calibrate(memory, day, features)
    return memory


def random_entries(n: int, seed: int = 0, doc: str = "doc", dim: int = 8):
    """n datastore entries of random fp16 keys and values, in 3 documents (`doc`0, 1, 2), positions 0..n-1."""
    from monim.storage.entries import Entries

    rng = np.random.default_rng(seed)
    return Entries(rng.standard_normal((n, dim)).astype(np.float16), rng.integers(0, 50000, n).astype(np.int32),
                   [f"{doc}{i % 3}" for i in range(n)], np.arange(n, dtype=np.int32))


def nearest_by_numpy(queries: np.ndarray, keys: np.ndarray, k: int,
                     allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Squared distances and ids of each query's k nearest keys (of the `allowed` ones), in float64."""
    d = ((queries[:, None].astype(np.float64) - keys[None].astype(np.float64)) ** 2).sum(-1)
    if allowed is not None:
        d = np.where(allowed[None], d, np.inf)
    return np.sort(d, 1)[:, :k], np.argsort(d, 1)[:, :k]


def at_once(call: Callable, items: list) -> list:
    """call(item) for each item, each from its own thread, all at the same time: the answers in order."""
    out: list = [None] * len(items)
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, call(items[i]))) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@contextmanager
def chromium() -> Iterator:
    """A headless Chromium through Playwright: the system's (Debian's `chromium`), else Playwright's own;
    the test is skipped where none starts."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
    system = shutil.which("chromium") or shutil.which("chromium-browser")
    with sync_api.sync_playwright() as p:
        try:
            browser = p.chromium.launch(args=["--no-sandbox"], **({"executable_path": system} if system else {}))
        except sync_api.Error as e:
            pytest.skip(f"no headless Chromium could start: {str(e).splitlines()[0]}")
        try:
            yield browser
        finally:
            browser.close()
