"""What several test files do the same way (plain functions; the fixtures are tests/conftest.py's):
the demo's articles as a small feed or texts, `monim learn` and its refusals, a memory learned in process,
random datastore entries, exact nearest neighbours by numpy, requests sent at once, a headless Chromium,
what a memory's files say (fingerprint) and the chaos drill (`monim learn` killed and resumed)."""

from __future__ import annotations

import datetime as dt
import gzip
import hashlib
import json
import random
import re
import shutil
import signal
import subprocess
import threading
import time
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


def _timeless(obj):
    """A record without what depends on the process that wrote it (timings, rates, tokens the LM ran
    then rather than before a kill, and on how many workers), with Θ's folders named by day, not by
    their random suffix."""
    if isinstance(obj, dict):
        return {k: _timeless(v) for k, v in obj.items()
                if "seconds" not in k and not k.endswith("per_s") and k not in ("tokens_featurized", "featurize_workers")}
    if isinstance(obj, list):
        return [_timeless(v) for v in obj]
    return re.sub(r"(theta/\d{4}-\d{2}-\d{2})-[0-9a-f]{8}", r"\1", obj) if isinstance(obj, str) else obj


def content(path: Path) -> str:
    """sha256 of what a file says: its bytes, or for a zip container (.npz, .pt: their entries carry
    the write time) its arrays, and for records their content without timings."""
    h = hashlib.sha256()
    if path.suffix == ".npz":
        with np.load(path) as f:
            for k in sorted(f.files):
                h.update(k.encode() + f[k].tobytes())
    elif path.suffix == ".pt":
        import torch

        saved = torch.load(path, weights_only=True)
        for k, v in sorted(saved.pop("state").items()):
            h.update(k.encode() + v.numpy().tobytes())
        h.update(json.dumps(_timeless(saved), sort_keys=True).encode())
    elif path.suffix == ".json":
        h.update(json.dumps(_timeless(json.loads(path.read_text())), sort_keys=True).encode())
    else:
        h.update(path.read_bytes())
    return h.hexdigest()


def fingerprint(memory: Path) -> dict[str, str]:
    """What every committed file of a memory says (shards by their checksums at commit, Θ's folders
    by content), named by day rather than by random suffix; and the manifest without those names (nor
    the checksums of Θ's files, whose bytes hold write times)."""
    manifest = json.loads((memory / "manifest.json").read_text())
    out = {}
    for day in manifest["days"]:
        out |= {f"shards/{day['date']}/{f}": digest for f, digest in day["checksums"].items()}
    for theta in manifest["thetas"]:
        folder = memory / theta["dir"]
        out |= {f"theta/{theta['date']}/{p.name}": content(p) for p in sorted(folder.iterdir())}
    strip = {**manifest, "days": [{k: v for k, v in d.items() if k != "shard"} for d in manifest["days"]],
             "thetas": [{k: v for k, v in t.items() if k not in ("dir", "checksums")}  # (bytes with write times:
                        for t in manifest["thetas"]]}                                  # their content is compared above)
    out["manifest"] = hashlib.sha256(json.dumps(_timeless(strip), sort_keys=True).encode()).hexdigest()
    return out


def chaos(monim, root: Path, kills: int, policy: str = "monim-amt", end: str = "1987-03-06", max_docs: int = 3,
          model: Path | None = None, own_api: bool = True, seed: int = 0) -> dict:
    """The chaos drill: `monim learn` of the demo from 1987-03-02 killed with SIGKILL at random moments and
    resumed each time (each command as from a fresh shell, or on the session's Prefect API), against an
    uninterrupted run into `root`: kills survived, days committed when each landed, files and bytes compared
    (shards byte for byte, Θ's calibrators by weights and records without timings, sample arrays by their
    arrays), whether the memories are identical and `monim fsck` clean, and the wall seconds of both runs."""
    rng = random.Random(seed)
    cmd = [monim.script, "learn", "--source", str(DEMO_STREAM), "--start", "1987-03-02", "--end", end, "--policy", policy,
           "--max-docs", str(max_docs)] + (["--model", str(model)] if model else [])
    logs = root / "logs"
    logs.mkdir(parents=True)

    def learn_into(workdir: Path, log: Path) -> subprocess.Popen:
        with log.open("w") as f:
            return subprocess.Popen([*cmd, "--workdir", str(workdir)], env=monim.env(own_api), stdout=f,
                                    stderr=subprocess.STDOUT)

    def finish(proc: subprocess.Popen, log: Path, what: str, timeout: float | None = None) -> None:
        assert proc.wait(timeout=timeout) == 0, f"{what} failed (exit {proc.returncode}):\n{log.read_text()[-4000:]}"

    def committed(workdir: Path) -> int:
        manifest = workdir / "memories" / policy / "manifest.json"
        return len(json.loads(manifest.read_text())["days"]) if manifest.exists() else 0

    t = time.perf_counter()
    finish(learn_into(root / "reference", logs / "reference.log"), logs / "reference.log", "the uninterrupted run")
    alone = time.perf_counter() - t
    log_of_kills, t = [], time.perf_counter()
    while len(log_of_kills) < kills:
        log = logs / f"kill-{len(log_of_kills) + 1}.log"
        proc = learn_into(root / "chaos", log)
        delay = rng.uniform(3, max(6.0, alone / 3))  # a resumed run's start-up (Prefect API, LM) is part of it
        try:  # finished before its kill: the rest of the kills land on a finished stream
            finish(proc, log, f"run {len(log_of_kills) + 1}", timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        log_of_kills.append({"after_s": round(delay, 1), "days_committed": committed(root / "chaos"),
                             "finished": proc.returncode == 0})
    finish(learn_into(root / "chaos", logs / "resumed.log"), logs / "resumed.log", "the resumed run")
    chaotic = time.perf_counter() - t
    fsck = monim("fsck", "--workdir", root / "chaos", "--json", check=False, own_api=own_api)
    want, got = fingerprint(root / "reference" / "memories" / policy), fingerprint(root / "chaos" / "memories" / policy)
    differ = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
    files = [p for p in (root / "chaos" / "memories" / policy).rglob("*") if p.is_file()]
    return {"kills": len(log_of_kills), "kills_mid_stream": sum(not k["finished"] for k in log_of_kills),
            "kill_log": log_of_kills, "files_compared": len(want),
            "bytes_compared": sum(p.stat().st_size for p in files if "shards" in p.parts or "theta" in p.parts),
            "identical": not differ, "differ": differ, "fsck_clean": fsck.returncode == 0,
            "fsck": json.loads(fsck.stdout.strip().splitlines()[-1]) if fsck.stdout.strip() else fsck.stderr[-2000:],
            "seconds_uninterrupted": round(alone, 1), "seconds_chaotic": round(chaotic, 1)}
