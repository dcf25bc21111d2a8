"""Chaos: `monim learn` killed with SIGKILL at random moments, resumed each time, must end with the
memory an uninterrupted run makes, byte for byte, a clean `monim fsck`, and each day once in MLflow.

Files are compared by what they say: shards byte for byte (their checksums at commit), Θ's
calibrators by weights and records (without timings), sample arrays by their arrays.
Prints a table and writes JSON: kills survived, days committed when each kill landed, files and
bytes compared, wall time of the uninterrupted run and of the chaotic one.
Usage: python benchmarks/chaos.py [--kills 20] [--days 5] [--policy monim-amt] [--max-docs 3] [--model M]
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import monim  # noqa: F401  (OMP_WAIT_POLICY before torch)
import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from harness import REPO, RESULTS, parser, save

MONIM = str(Path(sys.executable).parent / "monim")
DEMO = REPO / "monim" / "data" / "reuters-1987-03-02_03-13.jsonl.gz"


def learn(args, workdir: Path, log: Path) -> subprocess.Popen:
    """`monim learn` as from a fresh shell (its own Prefect API), or with --prefect-api on that API
    and this environment's Prefect home; its output goes to `log`."""
    drop = ("PREFECT_API_URL",) if args.prefect_api else ("PREFECT_HOME", "PREFECT_API_URL")
    env = {k: v for k, v in os.environ.items() if k not in drop} | ({"PREFECT_API_URL": args.prefect_api} if args.prefect_api else {})
    cmd = [MONIM, "learn", "--source", str(args.source), "--start", args.start, "--end", args.end, "--policy", args.policy,
           "--workdir", str(workdir), "--max-docs", str(args.max_docs)] + (["--model", args.model] if args.model else [])
    with log.open("w") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, log: Path, what: str, timeout: float | None = None) -> None:
    """Wait for a run that must succeed; if it fails, exit with the end of its output."""
    if proc.wait(timeout=timeout):
        sys.exit(f"{what} failed (exit {proc.returncode}); kept for a look: {log.parent.parent}. The end of its "
                 f"output:\n{log.read_text()[-4000:]}")


def committed_days(workdir: Path, policy: str) -> int:
    manifest = workdir / "memories" / policy / "manifest.json"
    return len(json.loads(manifest.read_text())["days"]) if manifest.exists() else 0


def _timeless(obj):
    """A record without what depends on the process that wrote it (timings, rates, tokens the LM ran
    then rather than before a kill), with Θ's folders named by day, not by their random suffix."""
    if isinstance(obj, dict):
        return {k: _timeless(v) for k, v in obj.items()
                if "seconds" not in k and not k.endswith("per_s") and k != "tokens_featurized"}
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


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--source", type=Path, default=DEMO)
    ap.add_argument("--start", default="1987-03-02")
    ap.add_argument("--end", default="1987-03-06")
    ap.add_argument("--policy", default="monim-amt")
    ap.add_argument("--max-docs", type=int, default=3)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefect-api", default=None, help="A Prefect API URL for every command (default: each starts its own, "
                    "as from a fresh shell)")
    ap.add_argument("--out", type=Path, default=RESULTS / "chaos.json")
    args = ap.parse_args()
    console, rng = Console(), random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="monim-chaos-"))
    t = time.perf_counter()
    reference = root / "reference"
    logs = root / "logs"
    logs.mkdir()
    finish(learn(args, reference, logs / "reference.log"), logs / "reference.log", "the uninterrupted run")
    alone = time.perf_counter() - t
    kills, t = [], time.perf_counter()
    while len(kills) < args.kills:
        log = logs / f"kill-{len(kills) + 1}.log"
        proc = learn(args, root / "chaos", log)
        delay = rng.uniform(3, max(6.0, alone / 3))  # a resumed run's start-up (Prefect API, LM) is part of it
        try:  # finished before its kill: the rest of the kills land on a finished stream
            finish(proc, log, f"run {len(kills) + 1}", timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        kills.append({"after_s": round(delay, 1), "days_committed": committed_days(root / "chaos", args.policy),
                      "finished": proc.returncode == 0})
        console.print(f"kill {len(kills)}: after {delay:.1f} s, {kills[-1]['days_committed']} days committed")
    finish(learn(args, root / "chaos", logs / "resumed.log"), logs / "resumed.log", "the resumed run")
    chaotic = time.perf_counter() - t
    fsck = subprocess.run([MONIM, "fsck", "--workdir", str(root / "chaos"), "--json"], capture_output=True, text=True)
    want, got = fingerprint(reference / "memories" / args.policy), fingerprint(root / "chaos" / "memories" / args.policy)
    differ = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
    files = [p for p in (root / "chaos" / "memories" / args.policy).rglob("*") if p.is_file()]
    result = {
        "kills": len(kills), "kills_mid_stream": sum(not k["finished"] for k in kills), "kill_log": kills,
        "files_compared": len(want), "bytes_compared": sum(p.stat().st_size for p in files if "shards" in p.parts or "theta" in p.parts),
        "identical": not differ, "differ": differ, "fsck_clean": fsck.returncode == 0,
        "fsck": json.loads(fsck.stdout.strip().splitlines()[-1]) if fsck.stdout.strip() else fsck.stderr[-2000:],
        "seconds_uninterrupted": round(alone, 1), "seconds_chaotic": round(chaotic, 1),
    }
    table = Table(title=f"chaos: {args.policy}, {args.start}..{args.end}, {args.max_docs} articles a day")
    for key in ("kills", "kills_mid_stream", "files_compared", "bytes_compared", "identical", "fsck_clean",
                "seconds_uninterrupted", "seconds_chaotic"):
        table.add_row(key, str(result[key]))
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(args.out, result)
    shutil.rmtree(root)
    if differ or fsck.returncode:
        sys.exit(1)


if __name__ == "__main__":
    main()
