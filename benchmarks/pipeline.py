"""A full news day through the day flow, against the physical bound: the LM body's forward pass.

For one day of a stream (every training article unless --max-docs): the body's throughput on the
day's tokens in full 512-token rows (the bound), scoring's throughput on the same articles, then
the real flows (Prefect + MLflow, fresh work directories): one policy alone, and `compare` of
several policies over the same day, with each stage's tokens/s as a ratio to the bound.
All in one process, so machine load cancels out of the ratios.
Usage: monim bench pipeline --source FILE --date 2022-06-02 [--max-docs N]
"""

import datetime as dt
import os
import tempfile
import time
from pathlib import Path

from benchmarks.harness import RTQA, parser, save
import torch
from rich.console import Console
from rich.table import Table

from monim.lm.model import load_lm
from monim.core.config import ScoreConfig
from monim.lm.scoring import score_tokens
from monim.lm.windows import fit_window
from monim.data.stream import read_day


def lm_bound(lm, seqs: list, cfg: ScoreConfig, tokens: int) -> dict:
    """Body tokens/s on the first `tokens` of the articles in full 512-token rows, and scoring
    tokens/s on the same articles (each timed after a warm-up)."""
    picked, n = [], 0
    for s in seqs:
        if n >= tokens:
            break
        picked.append(s)
        n += len(s[1])
    flat = torch.tensor([t for _, toks, _ in picked for t in toks][: n // 512 * 512]).view(-1, 512)
    rows = fit_window(lm, cfg).batch_size
    with torch.inference_mode():
        lm.forward(flat[:1, :64])
        t = time.perf_counter()
        for i in range(0, len(flat), rows):
            lm.forward(flat[i : i + rows].to(lm.device))
        body = flat.numel() / (time.perf_counter() - t)
    t = time.perf_counter()
    scored = sum(len(b) for b in score_tokens(lm, picked, cfg))
    rate = scored / (time.perf_counter() - t)
    return {"bound_tokens": int(flat.numel()), "body_tokens_per_s": body, "score_tokens_per_s": rate,
            "score_ratio": rate / body}


def task_seconds(since: dt.datetime) -> dict[str, float]:
    """Seconds of the task runs that started after `since`, summed by task (Prefect's API: what its
    UI shows), and the runs of each."""
    from prefect import get_client

    seconds: dict[str, float] = {}
    with get_client(sync_client=True) as client:
        offset = 0
        while batch := client.read_task_runs(limit=200, offset=offset):
            for r in batch:
                name = r.name.rsplit("-", 1)[0]
                if r.start_time and r.start_time >= since and not name.startswith("monim-"):  # not a subflow's own run
                    seconds[name] = seconds.get(name, 0.0) + r.total_run_time.total_seconds()
            offset += len(batch)
    return dict(sorted(seconds.items(), key=lambda kv: -kv[1]))


def flow_run(source: str, date: str, policies: list[str], max_docs: int | None, model: str | None) -> dict:
    """Run `compare` (or one policy's stream) over the day in a fresh work directory; its rows and
    its tasks' seconds."""
    from flows.compare import compare_policies
    from monim.core.run_config import RunConfig
    from monim.run import recorded_days

    workdir = tempfile.mkdtemp(prefix="monim-pipeline-")
    since = dt.datetime.now(dt.timezone.utc)
    t = time.perf_counter()
    cfg = RunConfig(source=source, workdir=workdir, model=model, max_docs=max_docs)
    compare_policies(cfg, date, date, policies)
    seconds = time.perf_counter() - t
    rows = {p: recorded_days(cfg.model_copy(update={"policy": p}))[date] for p in policies}
    return {"seconds": seconds, "rows": rows, "workdir": workdir, "tasks": task_seconds(since)}


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "pipeline")
    ap.add_argument("--source", default=str(RTQA))
    ap.add_argument("--date", type=dt.date.fromisoformat, default=dt.date(2022, 6, 2))
    ap.add_argument("--max-docs", type=int, default=None)
    ap.add_argument("--policies", default="fullmem,randmem,monim-amt")
    ap.add_argument("--bound-tokens", type=int, default=8192, help="Tokens for the body/scoring throughput.")
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="monim-pipeline-prefect-"))

    lm = load_lm(args.model)
    day = read_day(args.source, args.date)
    train = day.train[: args.max_docs]
    seqs = [(d.id, ids, 1) for d, ids in zip(train, lm.tokenizer([d.text for d in train])["input_ids"])]
    bound = lm_bound(lm, seqs, ScoreConfig(), args.bound_tokens)
    policies = args.policies.split(",")
    one = flow_run(args.source, args.date.isoformat(), policies[:1], args.max_docs, args.model)
    many = flow_run(args.source, args.date.isoformat(), policies, args.max_docs, args.model)
    body = bound["body_tokens_per_s"]
    runs = []
    for name, run in (("one policy", one), (f"compare of {len(policies)}", many)):
        rows = run["rows"].values()
        lm_tokens = sum(r.get("tokens_featurized", 0) for r in rows)  # train + validation + test, once
        sec = {k: sum(r.get(f"seconds_{k}", 0.0) for r in rows) for k in ("featurize", "lm_and_search", "policy", "commit", "index")}
        runs.append({"run": name, "seconds": run["seconds"], "lm_tokens": lm_tokens, "featurize_s": sec["featurize"],
                     "lm_ratio": lm_tokens / sec["featurize"] / body if sec["featurize"] else None,
                     "memorize_s": sum(v for k, v in sec.items() if k != "featurize"),
                     "calibrate_s": sum(r.get("calibrator_seconds", 0.0) for r in rows),
                     "evaluate_s": sum(r.get("evaluate_seconds", 0.0) for r in rows),
                     "day_ratio": lm_tokens / run["seconds"] / body, "tasks": run["tasks"],
                     # beyond the day's work (the LM pass, learning, evaluating): Prefect, MLflow, model load, report
                     "fixed_s": run["seconds"] - sec["featurize"] - sum(r.get("seconds_learn", 0.0) for r in rows)
                     - sum(r.get("evaluate_seconds", 0.0) for r in rows)})
    out = {"source": args.source, "date": args.date.isoformat(), "articles": len(train),
           "tokens": sum(len(s[1]) - 1 for s in seqs), "threads": torch.get_num_threads(), "device": str(lm.device),
           **bound, "one_seconds": one["seconds"], "compare_seconds": many["seconds"],
           "compare_ratio": many["seconds"] / one["seconds"], "runs": runs}
    table = Table(title=f"{Path(args.source).name} {args.date}: {out['articles']} training articles, {out['tokens']} "
                        f"tokens, {out['threads']} threads; body {body:.0f} tok/s, scoring {bound['score_ratio']:.2f}× of it")
    for col in ("run", "LM tokens", "LM s", "LM × body", "memorize s", "calibrator s", "evaluate s", "wall s", "day × body"):
        table.add_column(col, justify="right")
    for r in runs:
        table.add_row(r["run"], str(r["lm_tokens"]), f"{r['featurize_s']:.0f}", f"{r['lm_ratio']:.2f}" if r["lm_ratio"] else "-",
                      f"{r['memorize_s']:.0f}", f"{r['calibrate_s']:.0f}", f"{r['evaluate_s']:.0f}", f"{r['seconds']:.0f}",
                      f"{r['day_ratio']:.2f}")
    Console(width=160).print(table)
    print(f"one policy {one['seconds']:.0f} s; compare of {len(policies)} {many['seconds']:.0f} s "
          f"({out['compare_ratio']:.2f}×)")
    for r in runs:
        print(f"{r['run']}: {r['fixed_s']:.0f} s ({r['fixed_s'] / r['seconds']:.0%}) beyond the LM, learning and "
              "evaluating; tasks (s): " + ", ".join(f"{k} {v:.1f}" for k, v in r["tasks"].items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(args.out, out, args)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
