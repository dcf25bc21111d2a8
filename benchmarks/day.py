"""A short day's cost: `monim compare` of several policies over news days against the LM's own seconds.

The whole `monim compare` command (a process, as a user runs it: Prefect, MLflow, the LM's pass
through the feature store, every policy's learning and evaluation, the report) over the first DAYS
days of a stream (default: the bundled Reuters demo stream, 100 training articles a day), then, in
the LM's seconds every ratio is taken against: its pass as the compare made it (the first policy's
featurize of every split's articles; the others read the feature store), timed inside the compare, so
the machine's load weighs on both alike; beside it, the physical bound: in this process, the bare LM's
forward pass over the same tokens in full 512-token rows. Per day and policy, from the rows the runs
recorded: the LM's pass, learning (memorize, its search, calibrate), evaluation, MemRate and PPL so far, and the share of training tokens MoNIM's
decision searched; per day, MoNIM-AMT's learning against FullMem's; the demo table's PPL and MemRate
per policy. Goals (issue 68): compare ≤ 1.6× the LM's seconds, MoNIM's learning ≤ 1.1× FullMem's.
A full-volume study: `--source PATH --max-docs all` (e.g. Reuters-21578 from the shared data);
`--workdir W` keeps the runs (a rerun learns only the days W lacks, and times only that).
Further `monim compare` options go after `--` (e.g. `-- --exact-below 100000`).
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import parser, save

MEMORIZE = ("lm_and_search", "policy", "merge", "commit", "index")  # MemoryRun's memorize stages (DayStats.seconds)
GOALS = {"compare_vs_lm": 1.6, "monim_vs_fullmem_learn": 1.1}
ROW = 512  # tokens a row of the LM's timed forward pass


def max_docs(text: str) -> int | None:
    """--max-docs: a number of training articles a day, or "all"."""
    return None if text == "all" else int(text)


def compare(args, dates: list[dt.date], workdir: Path) -> dict:
    """Run `monim compare` over the days as a whole process: its seconds and its JSON answer."""
    monim = str(Path(sys.executable).parent / "monim")
    command = [monim, "compare", "--source", str(args.source), "--start", dates[0].isoformat(),
               "--end", dates[-1].isoformat(), "--policies", args.policies, "--workdir", str(workdir), "--json",
               *(["--max-docs", str(args.max_docs)] if args.max_docs is not None else []),
               *(["--model", args.model] if args.model else []), *args.compare_options]
    started = time.perf_counter()
    out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
    return {"command": command, "seconds": time.perf_counter() - started,
            "answer": json.loads(out.stdout.strip().splitlines()[-1])}


def body_seconds(args, dates: list[dt.date], workdir: Path, policy: str) -> dict:
    """The bare LM's forward pass over the days' tokens (every split, as `policy`'s run read them), in
    full rows of ROW tokens, timed after a warm-up (`--lm-tokens`: the first that many, scaled up)."""
    import torch

    from monim.core.config import ScoreConfig

    from monim.core.run_config import RunConfig
    from monim.lm.windows import fit_window
    from monim.run import make_run

    run = make_run(RunConfig(source=str(args.source), workdir=str(workdir), policy=policy, max_docs=args.max_docs,
                             **({"model": args.model} if args.model else {})))
    tokens: list[int] = []
    for date in dates:
        day = run.ingest(date)
        for split in run.splits:
            tokens += [t for ids in run.features.tokenize(day.split(split)) for t in ids]
    lm = run.lm
    timed = tokens[: args.lm_tokens] if args.lm_tokens else tokens
    flat = torch.tensor(timed[: max(ROW, len(timed) // ROW * ROW)]).view(-1, ROW)
    rows = fit_window(lm, ScoreConfig()).batch_size
    with torch.inference_mode():
        lm.forward(flat[:1, :64].to(lm.device))
        started = time.perf_counter()
        for i in range(0, len(flat), rows):
            lm.forward(flat[i : i + rows].to(lm.device))
        seconds = time.perf_counter() - started
    rate = flat.numel() / seconds
    return {"tokens": len(tokens), "timed_tokens": int(flat.numel()), "tokens_per_s": rate, "seconds": len(tokens) / rate,
            "device": str(lm.device), "threads": torch.get_num_threads()}


def stages(row: dict) -> dict:
    """A policy's day from its row: the LM's pass, learning split into its stages, evaluation (seconds)."""
    memorize = sum(row.get(f"seconds_{s}", 0.0) for s in MEMORIZE)
    learn = row["seconds_learn"]
    searched = row.get("decision_searched")
    return {"lm_pass": row["seconds_featurize"], "memorize": memorize, "search": row.get("seconds_search", 0.0),
            "calibrate": learn - memorize, "calibrator": row.get("calibrator_seconds", 0.0),
            "calibration_tokens": row.get("calibration_tokens"), "learn": learn,
            "evaluate": row.get("evaluate_seconds", 0.0), "tokens_seen": row.get("tokens_seen"),
            "searched_share": searched / row["tokens_seen"] if searched is not None and row.get("tokens_seen") else None,
            "entries": row.get("entries"), "memrate_percent_so_far": row.get("memrate_percent_so_far"), "ppl_so_far": row.get("ppl_so_far")}


def main(argv: list[str] | None = None) -> None:
    from monim.core.config import DEMO_STREAM

    ap = parser(__doc__, "day")
    ap.add_argument("--source", type=Path, default=DEMO_STREAM, help="The news stream (default: the bundled demo stream).")
    ap.add_argument("--start", type=dt.date.fromisoformat, default=None, help="The first day (default: the stream's first).")
    ap.add_argument("--days", type=int, default=3)
    ap.add_argument("--max-docs", type=max_docs, default=100, help='Training articles a day, or "all".')
    ap.add_argument("--policies", default="fullmem,randmem,monim-amt", help="Comma-separated, as `monim compare` takes them.")
    ap.add_argument("--model", default=None)
    ap.add_argument("--workdir", type=Path, default=None, help="The runs' folder (default: a fresh temporary one).")
    ap.add_argument("--lm-tokens", type=int, default=None,
                    help="Time the LM's forward pass on the first this many tokens and scale up (default: all).")
    ap.add_argument("compare_options", nargs="*", help="Further `monim compare` options, after --.")
    args = ap.parse_args(argv)
    from monim.core.catalogue import learning_order
    from monim.data.stream import list_dates
    from monim.run import recorded_days
    from monim.core.run_config import RunConfig

    dates = list_dates(args.source, start=args.start)[: args.days]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="monim-bench-day-"))
    policies = args.policies.split(",")
    ran = compare(args, dates, workdir)
    lm = body_seconds(args, dates, workdir, policies[0])
    rows = {p: recorded_days(RunConfig(source=str(args.source), workdir=str(workdir), policy=p)) for p in policies}
    days = []
    for date in (d.isoformat() for d in dates):
        runs = {p: stages(rows[p][date]) for p in learning_order(policies) if date in rows[p]}
        day = {"date": date, "runs": runs, "learn": sum(r["learn"] for r in runs.values())}
        if "monim-amt" in runs and "fullmem" in runs:
            day["monim_vs_fullmem_learn"] = runs["monim-amt"]["learn"] / runs["fullmem"]["learn"]
        days.append(day)
    answer = ran["answer"]["policies"]
    result = {"source": str(args.source), "dates": [d.isoformat() for d in dates], "max_docs": args.max_docs,
              "policies": policies, "goals": GOALS, "compare_seconds": ran["seconds"], "lm": lm,
              "lm_pass_seconds": (lm_pass := sum(r["lm_pass"] for d in days for r in d["runs"].values())),
              "compare_vs_lm": ran["seconds"] / lm_pass, "compare_vs_body": ran["seconds"] / lm["seconds"],
              "learn_seconds": sum(d["learn"] for d in days),
              "evaluate_seconds": sum(r["evaluate"] for d in days for r in d["runs"].values()),
              "monim_vs_fullmem_learn_max": max((d["monim_vs_fullmem_learn"] for d in days if "monim_vs_fullmem_learn" in d),
                                                default=None),
              "table": {p: {k: answer[p][k] for k in ("ppl", "memrate", "entries", "tokens_seen", "seconds_learn")}
                        for p in policies},
              "days": days, "workdir": str(workdir), "command": ran["command"]}
    save(args.out, result, args)
    print(f"{', '.join(policies)} over {len(dates)} days of {args.source.name} ({args.max_docs or 'every'} articles a day): "
          f"compare {ran['seconds']:.0f} s = {result['compare_vs_lm']:.2f}x its LM pass's {lm_pass:.0f} s (goal "
          f"{GOALS['compare_vs_lm']}x; learning {result['learn_seconds']:.0f} s, evaluation {result['evaluate_seconds']:.0f} s), "
          f"{result['compare_vs_body']:.2f}x the bare LM body's {lm['seconds']:.0f} s ({lm['tokens']} tokens at "
          f"{lm['tokens_per_s']:.0f} tok/s in full rows, timed after the compare)")
    print("day        " + "".join(f"{p + ' learn s':>20}" for p in policies) + "   MoNIM/FullMem learn (goal 1.1)")
    for d in days:
        print(f"{d['date']} " + "".join(f"{d['runs'][p]['learn']:>20.1f}" if p in d["runs"] else f"{'-':>20}" for p in policies)
              + f"   {d.get('monim_vs_fullmem_learn', float('nan')):.2f}x")
    for p in policies:
        print(f"{p}: PPL {answer[p]['ppl']:.4f}, MemRate {answer[p]['memrate']:.4f}, learning {answer[p]['seconds_learn']:.0f} s")


if __name__ == "__main__":
    main()
