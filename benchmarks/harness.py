"""What the benches share: where things are (the repository, the shared data, the results), a bench's
command line, its result JSON (written atomically with its envelope, read back to resume), a monim
command's JSON, the served model's requests and the news days a small study reads. Every bench imports
it first (`from benchmarks.harness import ...`): it sets the environment a monim process needs before
torch, Prefect or MLflow is imported (a bench is an entry point: `monim bench NAME`, `python -m benchmarks.NAME`)."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import itertools
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from monim.core.atomic import replacing  # the standard library only: gpu.py runs where FAISS, Prefect and MLflow are not
from monim.core.environment import set_defaults

if TYPE_CHECKING:
    from monim.data.day import Day

set_defaults()
REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("MONIM_DATA", REPO.parent / "shared" / "data"))  # as the tests read it
RTQA = DATA / "news" / "realtimeqa-2022-06-to-09.jsonl.gz"
QUIZ = DATA / "qa" / "realtimeqa-quiz-2022-06-to-09.jsonl"
REUTERS = DATA / "news" / "reuters21578.jsonl.gz"
RESULTS = REPO / "docs" / "results"  # a bench NAME's results: RESULTS / NAME
WORK = REPO / "work" / "bench"  # the benches' work directories (ignored, beside the code, never inside a package)
MONIM = str(Path(sys.executable).parent / "monim")
VERSIONS = ("torch", "transformers", "faiss-gpu", "faiss-cpu", "numpy", "scipy", "prefect", "mlflow")


class Parser(argparse.ArgumentParser):
    """A bench's argument parser: it keeps the bench's name, the options it was given and when it parsed them
    (the envelope's command and start)."""

    bench: str | None = None
    argv: list[str] = []
    started: str | None = None

    def parse_args(self, args=None, namespace=None):
        Parser.argv = list(sys.argv[1:] if args is None else args)
        Parser.started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        Parser.bench = self.bench
        return super().parse_args(args, namespace)


def parser(doc: str, name: str | None = None) -> argparse.ArgumentParser:
    """A bench's command line: its docstring as the help and, for a bench `name`, --out (its result JSON,
    docs/results/NAME/NAME.json)."""
    ap = Parser(prog=f"monim bench {name}" if name else None, description=doc,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.bench = name
    if name:
        ap.add_argument("--out", type=Path, default=RESULTS / name / f"{name}.json", help="The result JSON.")
    return ap


def news_parser(doc: str, name: str) -> argparse.ArgumentParser:
    """A study over the first news days: the stream, its first day, how many days, articles a day, the LM."""
    ap = parser(doc, name)
    ap.add_argument("--source", type=Path, default=RTQA)
    ap.add_argument("--start", type=dt.date.fromisoformat, default=dt.date(2022, 6, 1))
    ap.add_argument("--days", type=int, default=10)
    ap.add_argument("--max-docs", type=int, default=8)
    ap.add_argument("--model", default=None)
    return ap


def first_days(args: argparse.Namespace) -> list[Day]:
    """The first `args.days` days of the stream from `args.start`."""
    from monim.data.feed import open_feed
    from monim.data.stream import iter_days

    return list(itertools.islice(iter_days(open_feed(args.source), start=args.start), args.days))


def resume(path: Path, empty: dict | list) -> dict | list:
    """The result saved so far (a stopped bench resumes from it; an envelope's result), else `empty`."""
    if not Path(path).exists():
        return empty
    saved = json.loads(Path(path).read_text())
    return saved["result"] if isinstance(saved, dict) and {"bench", "result"} <= saved.keys() else saved


def git(*args: str) -> str | None:
    """A git command's output in the repository (None without git or a repository)."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def machine() -> dict:
    """The CPU's model, its cores, the memory and the GPU (None without one)."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = None
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        gpu = sys.modules["torch"].cuda.get_device_name()
    elif shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
        gpu = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": None if memory is None else round(memory, 1), "gpu": gpu}


def versions() -> dict[str, str]:
    """Python's, monim's (this tree's) and those of the packages a bench's figures depend on, where installed."""
    from monim import __version__

    out = {"python": platform.python_version(), "monim": __version__}
    for name in VERSIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def within_repo(value: object) -> object:
    """A path inside the repository as it reads from its root (a result names no one's checkout), else the value."""
    if isinstance(value, (str, Path)) and Path(value).is_absolute() and Path(value).resolve().is_relative_to(REPO):
        return str(Path(value).resolve().relative_to(REPO))
    return value


def envelope(result: dict | list, args: argparse.Namespace) -> dict:
    """A result with what made it: the bench and its command, the commit (and whether the tree had changes
    outside docs/results), the machine, the package versions, the options, when it started and ended."""
    name = Parser.bench
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/results")
    return {"bench": name, "command": shlex.join(["monim", "bench", str(name), *Parser.argv]),
            "commit": git("rev-parse", "HEAD"), "dirty": None if dirty is None else bool(dirty),
            "machine": machine(), "versions": versions(), "options": {k: within_repo(v) for k, v in vars(args).items()},
            "started": Parser.started,
            "ended": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "result": result}


def save(path: Path, result: dict | list, args: argparse.Namespace | None = None, default=None) -> None:
    """Write a result JSON atomically (a kill while writing keeps what was written before): with `args`, the
    bench's result in its envelope; without, a work file as it is."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    saved = result if args is None else envelope(result, args)
    with replacing(path) as tmp:
        tmp.write_text(json.dumps(saved, indent=1, default=lambda x: str(x) if isinstance(x, (Path, dt.date))
                                  else (default or str)(x)) + "\n")


def monim_json(*args: str) -> dict:
    """A monim command's last JSON line (it must succeed)."""
    out = subprocess.run([MONIM, *map(str, args), "--json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def requests_pool(n_texts: int, n_prompts: int, new_tokens: int) -> list[dict]:
    """Distinct requests to a served model from the demo stream's articles: texts of ~1,000 characters
    to score, and article openings to continue."""
    from monim.core.config import DEMO_STREAM
    from monim.data.feed import open_feed
    from monim.data.stream import iter_days

    docs = [d for day in iter_days(open_feed(DEMO_STREAM)) for d in day.train + day.test]
    texts = [{"dataframe_records": [{"text": d.text[:1000]}]} for d in docs[:n_texts]]
    prompts = [{"dataframe_records": [{"prompt": " ".join(d.text.split()[:12])}], "params": {"max_new_tokens": new_tokens}}
               for d in docs[n_texts : n_texts + n_prompts]]
    return [r for pair in zip(texts, prompts) for r in pair] + texts[len(prompts):] + prompts[len(texts):]
