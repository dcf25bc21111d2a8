"""MoNIM's MemRate against a stream's redundancy: a day with a share of yesterday's articles copied or reworded.

How MoNIM's MemRate answers a stream's redundancy: a day learned onto the memory of the day before,
with a share s of its training articles replaced by articles of the day before, either copied whole
("copy") or as a rewrite that drops each one's first sentence ("lead dropped", the same story
reworded at its top, so every key's context differs from the stored one at first).
Prints, per share and kind: the day's MemRate, and MemRate on the replaced articles' tokens alone
(from the stored entries' documents). Resumable: the base memory is kept; each share is learned
into a copy of it. Every memory is a run's (monim.run.MemoryRun, MoNIM-AMT, the LM's features
from --features): the base day is learned the product's way (`learn`: memorized, then calibrated,
so the day after reads its Θ); a share's day is only memorized (`memorize`), the stage the study
measures, into a copy thrown away after it.
Usage: monim bench redundancy --source FILE --base 1987-03-02 --day 1987-03-03 --features DIR --workdir DIR
"""

import dataclasses
import datetime as dt
import json
import re
import shutil
from collections import Counter
from pathlib import Path

from benchmarks.harness import parser, save
import numpy as np

from monim.core.run_config import RunConfig
from monim.lm.features import Features
from monim.run import MemoryRun, make_run
from monim.data.feed import Document
from monim.data.day import Day
from monim.data.stream import read_day


def lead_dropped(text: str) -> str:
    """The article without its first sentence (the text as it is when it has one sentence)."""
    parts = re.split(r"(?<=[.!?])\s+", text.strip(), maxsplit=1)
    return parts[1] if len(parts) == 2 and len(parts[1]) > 200 else text


def redundant_day(day: Day, before: Day, share: float, kind: str, seed: int = 0) -> tuple[Day, set[str]]:
    """The day with `share` of its training articles replaced by articles of the day before; the new ids."""
    rng = np.random.default_rng(seed)
    n = round(share * len(day.train))
    out = list(day.train)
    replaced = rng.choice(len(out), n, replace=False)
    donors = rng.choice(len(before.train), n, replace=n > len(before.train))
    ids = set()
    for i, j in zip(replaced, donors):
        doc = before.train[j]
        text = doc.text if kind == "copy" else lead_dropped(doc.text)
        out[i] = Document(f"{kind}-{i}-{doc.id}", day.date, text, doc.title)
        ids.add(out[i].id)
    return dataclasses.replace(day, train=out), ids


def study_run(cfg: RunConfig, root: Path, store: Path) -> MemoryRun:
    """The policy's run learning into `root`, the LM's features read from and kept in `store`."""
    run = make_run(cfg, root=root)
    run.features = dataclasses.replace(Features.of(cfg, run.lm), store=store)
    return run


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "redundancy")
    ap.add_argument("--source", required=True)
    ap.add_argument("--base", type=dt.date.fromisoformat, required=True)
    ap.add_argument("--day", type=dt.date.fromisoformat, required=True)
    ap.add_argument("--shares", default="0,0.25,0.5,1")
    ap.add_argument("--kinds", default="copy,lead-dropped")
    ap.add_argument("--features", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--model")
    args = ap.parse_args(argv)
    cfg = RunConfig(policy="monim-amt", workdir=str(args.workdir), model=args.model)
    base_dir = args.workdir / "base"
    before, day = read_day(args.source, args.base), read_day(args.source, args.day)
    study_run(cfg, base_dir, args.features).learn(before, 0)  # a no-op where the base learned the day already
    rows_path = args.workdir / "rows.json"
    rows = json.loads(rows_path.read_text()) if rows_path.exists() else {}
    for kind in args.kinds.split(","):
        for share in map(float, args.shares.split(",")):
            key = f"{kind}@{share:g}"
            if key in rows or (share == 0 and any(k.endswith("@0") for k in rows)):
                continue
            target = args.workdir / key.replace("@", "-")
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(base_dir, target)
            synthetic, ids = redundant_day(day, before, share, kind)
            run = study_run(cfg, target, args.features)
            stats = run.memorize(synthetic)
            memory, features = run.memory, run.features
            sizes = dict(zip((d.id for d in synthetic.train), (len(t) - 1 for t in features.tokenize(synthetic.train))))
            shard = next(d.shard for d in memory.ds.days if d.date == args.day.isoformat())
            names = memory.ds.shards.shard_docs(shard)
            stored = Counter(names[i] for i in np.asarray(memory.ds.shards.shard(shard, "docs")))
            on_replaced = sum(stored.get(i, 0) for i in ids) / max(sum(sizes[i] for i in ids), 1)
            rows[key] = {"kind": kind, "share": share, "replaced_token_share": sum(sizes[i] for i in ids) / sum(sizes.values()),
                         "memrate": stats["memrate"], "memrate_replaced": on_replaced if ids else None,
                         "memrate_rest": (stats["stored"] - sum(stored.get(i, 0) for i in ids))
                         / max(stats["tokens_seen"] - sum(sizes[i] for i in ids), 1)}
            save(rows_path, rows)
            print(key, {k: round(v, 4) if isinstance(v, float) else v for k, v in rows[key].items()}, flush=True)
            shutil.rmtree(target)
    print("| kind | share of articles | share of tokens | MemRate | on the replaced articles | on the rest |\n|---|---|---|---|---|---|")
    for r in sorted(rows.values(), key=lambda r: (r["kind"], r["share"])):
        rep = f"{r['memrate_replaced']:.1%}" if r["memrate_replaced"] is not None else ""
        print(f"| {r['kind']} | {r['share']:.0%} | {r['replaced_token_share']:.1%} | {r['memrate']:.1%} | {rep} | {r['memrate_rest']:.1%} |")
    save(args.out, rows, args)


if __name__ == "__main__":
    main()
