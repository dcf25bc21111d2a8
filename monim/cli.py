"""The `monim` command line."""

from __future__ import annotations

import json
import math
import time
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


@app.callback()
def main() -> None:
    """monim: keep a language model up to date with a daily news stream, without retraining it."""


@app.command()
def run(
    days: int = typer.Option(3, help="How many days of the bundled Reuters stream to score."),
    max_docs: int = typer.Option(8, help="Training documents scored per day (all test documents are)."),
    model: Optional[str] = typer.Option(None, help="Model: alias, .gguf file, local dir or hub name."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object as the last line."),
) -> None:
    """Score a few days of the bundled demo stream with the default LM: per-day PPL and tokens."""
    from rich.progress import Progress

    from monim.lm import count_targets, load_lm, score
    from monim.stream import DEMO_STREAM, iter_days, open_source

    with console.status("loading the LM (the first run converts the GGUF, ~30 s)"):
        lm = load_lm(model)
    plan = []
    for day in iter_days(open_source(DEMO_STREAM)):
        plan.append((day.date, {"train": day.train[:max_docs], "test": day.test}))
        if len(plan) == days:
            break
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("scoring", total=sum(count_targets(lm, d) for _, s in plan for d in s.values()))
        for date, splits in plan:
            row: dict = {"date": date.isoformat()}
            for name, docs in splits.items():
                started, tokens, nll = time.perf_counter(), 0, 0.0
                for batch in score(lm, docs):
                    tokens += len(batch)
                    nll -= float(batch.logp.sum())
                    progress.advance(task, len(batch))
                row[f"{name}_docs"], row[f"{name}_tokens"] = len(docs), tokens
                row[f"{name}_ppl"] = math.exp(nll / tokens) if tokens else None
                row[f"{name}_tokens_per_s"] = tokens / (time.perf_counter() - started)
            rows.append(row)

    table = Table(title=f"{lm.name} on the bundled Reuters-21578 demo stream")
    for col in ("day", "train docs", "train tokens", "train PPL", "test docs", "test tokens", "test PPL", "tokens/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["date"], str(r["train_docs"]), str(r["train_tokens"]), _fmt(r["train_ppl"]),
            str(r["test_docs"]), str(r["test_tokens"]), _fmt(r["test_ppl"]), f"{r['train_tokens_per_s']:.0f}",
        )
    console.print(table)
    if as_json:
        print(json.dumps({"model": lm.name, "days": rows}))
