"""The command line as a user feels it: whole processes (median and spread of --runs) against the floors.

A refused argument, `monim compare` again with nothing new to learn (fullmem, randmem and monim-amt over the
demo's first days), `monim generate` of one token and `monim fsck` on that work directory, each in seconds and
as a ratio to `monim --help` and to `python -c "import torch"` run on the same machine just before; beside them
the imports that floor generate (torch and transformers' model classes) and fsck (MLflow's store). The work
directory (the demo feed, the comparison learned) is prepared once and not timed: --workdir reuses one.
Goals (issue 68): a refusal <= 1 s, nothing to learn <= 3 s, generate's first token <= 1.5 s after import torch.
"""

from __future__ import annotations

import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import MONIM, WORK, parser, save

NAME = "cli"
POLICIES = "fullmem,randmem,monim-amt"
PROMPT = "The Bank of Japan said"
FLOORS = ("monim --help", "import torch")  # every command's ratios are to these
# what the floors of generate and fsck import: torch with transformers' model classes; MLflow's store
IMPORTS = {"import torch, transformers' models": "import torch; from transformers import PreTrainedModel",
           "import MLflow's store": "import mlflow.store.tracking.sqlalchemy_store"}


def prepare(workdir: Path, start: str, end: str, max_docs: int) -> list[str]:
    """The demo feed and the comparison learned in the work directory (untimed; nothing is learned again where it
    is there already); the comparison's command."""
    workdir.mkdir(parents=True, exist_ok=True)
    feed = workdir / "news.jsonl.gz"
    if not feed.exists():
        subprocess.run([MONIM, "demo-feed", str(feed)], check=True)
    compare = [MONIM, "compare", "--source", str(feed), "--start", start, "--end", end, "--policies", POLICIES,
               "--max-docs", str(max_docs), "--workdir", str(workdir / "work")]
    subprocess.run(compare, check=True, stdout=subprocess.DEVNULL)
    return compare


def commands(workdir: Path, compare: list[str]) -> dict[str, tuple[list[str], int]]:
    """What is timed: name -> (the command, the exit status it must end with)."""
    work = str(workdir / "work")
    return {
        "monim --help": ([MONIM, "--help"], 0),
        "import torch": ([sys.executable, "-c", "import torch"], 0),
        "a refused argument": ([MONIM, "learn", "--source", str(workdir / "news.jsonl.gz"), "--start", "1987-03-05",
                                "--end", "1987-03-02", "--workdir", work], 2),
        "compare, nothing new": (compare, 0),
        "generate 1 token": ([MONIM, "generate", "--workdir", work, "--prompt", PROMPT, "--max-new-tokens", "1"], 0),
        "fsck": ([MONIM, "fsck", "--workdir", work], 0),
    } | {name: ([sys.executable, "-c", code], 0) for name, code in IMPORTS.items()}


def timed(command: list[str], status: int, runs: int) -> dict:
    """The command's wall seconds over `runs` whole processes: each, the median, the fastest, the slowest, the spread."""
    seconds = []
    for _ in range(runs):
        started = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True)
        seconds.append(time.perf_counter() - started)
        if proc.returncode != status:
            raise RuntimeError(f"{shlex.join(command)} ended with {proc.returncode}, not {status}:\n{proc.stderr[-2000:]}")
    return {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds),
            "spread": max(seconds) - min(seconds), "seconds": seconds}


def goals(medians: dict[str, float]) -> dict[str, dict]:
    """Issue 68's goals, each with its limit in seconds on this machine and whether the median met it."""
    limits = {"a refused argument": ("<= 1 s", 1.0), "compare, nothing new": ("<= 3 s", 3.0),
              "generate 1 token": ("<= import torch + 1.5 s", medians["import torch"] + 1.5)}
    return {name: {"goal": goal, "limit_s": limit, "met": medians[name] <= limit} for name, (goal, limit) in limits.items()}


def measure(named: dict[str, tuple[list[str], int]], runs: int) -> dict:
    """Every command timed (the floors first), with its ratios to the floors and the goals."""
    times = {name: timed(command, status, runs) for name, (command, status) in named.items()}
    medians = {name: t["median"] for name, t in times.items()}
    return {"commands": {name: shlex.join(command) for name, (command, _) in named.items()}, "runs": runs,
            "seconds": times,
            "ratio": {name: {f"x {floor}": medians[name] / medians[floor] for floor in FLOORS} for name in named},
            "goals": goals(medians)}


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, NAME)
    ap.add_argument("--runs", type=int, default=5, help="Whole processes of each command (median and spread).")
    ap.add_argument("--workdir", type=Path, default=WORK / NAME, help="The demo's feed and work directory (prepared "
                    "once, then reused).")
    ap.add_argument("--start", default="1987-03-02", help="The comparison's first day.")
    ap.add_argument("--end", default="1987-03-04", help="The comparison's last day.")
    ap.add_argument("--max-docs", type=int, default=16, help="The comparison's training articles a day.")
    args = ap.parse_args(argv)
    compare = prepare(args.workdir, args.start, args.end, args.max_docs)
    result = measure(commands(args.workdir, compare), args.runs)
    save(args.out, result, args)
    for name, t in result["seconds"].items():
        goal = result["goals"].get(name)
        print(f"{name:36} {t['median']:6.2f} s (spread {t['spread']:.2f})  x{result['ratio'][name]['x monim --help']:5.1f} "
              f"--help  x{result['ratio'][name]['x import torch']:4.2f} torch"
              + (f"  goal {goal['goal']}: {'met' if goal['met'] else 'not met'}" if goal else ""))


if __name__ == "__main__":
    main()
