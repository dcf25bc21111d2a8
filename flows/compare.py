"""Several policies over the same days, into one MLflow experiment, with a comparison table."""

from __future__ import annotations

import math

from prefect import flow
from prefect.artifacts import create_table_artifact

from flows.stream import learn_stream

POLICIES = ["bare", "fullmem", "randmem", "monim", "monim-amt"]


def _token_mean(rows: list[dict], key: str, log: bool = False) -> float:
    """Test-token-weighted mean of a per-day metric (geometric for perplexities)."""
    tokens = sum(r["tokens"] for r in rows)
    if not tokens:
        return math.nan
    mean = sum((math.log(r[key]) if log else r[key]) * r["tokens"] for r in rows) / tokens
    return math.exp(mean) if log else mean


def summarize(rows: list[dict]) -> dict:
    """A run's totals: MemRate, test PPL and accuracy over all its days, entries and bytes."""
    seen = sum(r.get("tokens_seen", 0) for r in rows)
    last = rows[-1] if rows else {}
    return {
        "days": len(rows), "test_tokens": sum(r["tokens"] for r in rows),
        "ppl": _token_mean(rows, "ppl", log=True), "ppl_lm": _token_mean(rows, "ppl_lm", log=True),
        "accuracy": _token_mean(rows, "accuracy"), "tokens_seen": seen, "entries": last.get("entries", 0),
        "memrate": last.get("entries", 0) / seen if seen else 0.0, "bytes": last.get("memory_bytes", 0),
    }


@flow(name="monim-compare")
def compare_policies(source: str, start: str | None = None, end: str | None = None, policies: list[str] | None = None,
                     workdir: str = "monim-work", model: str | None = None, max_docs: int | None = None,
                     seed: int = 0, experiment: str | None = None, tracking_uri: str | None = None,
                     calibrated: bool = True, calibrator_params: dict | None = None) -> dict[str, dict]:
    """Run each policy over the same days; RandMem stores at MoNIM's rate when MoNIM runs too."""
    policies = policies or POLICIES
    order = sorted(policies, key=lambda p: p != "monim-amt" and p != "monim")  # MoNIM first, for RandMem's rate
    summary: dict[str, dict] = {}
    for policy in order:
        params = {}
        if policy == "randmem":
            monim = summary.get("monim-amt") or summary.get("monim")
            params = {"rate": round(monim["memrate"], 4)} if monim else {}
        rows = learn_stream(source, start, end, policy, workdir, model, max_docs, params, seed, experiment, tracking_uri,
                            calibrated, calibrator_params)
        summary[policy] = summarize(rows)
    table = [{"policy": p} | {k: round(v, 4) if isinstance(v, float) else v for k, v in summary[p].items()} for p in policies]
    create_table_artifact(table, key="monim-comparison", description=f"{source} {start}..{end}")
    return {p: summary[p] for p in policies}
