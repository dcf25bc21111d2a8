"""A run's running totals over its days: what the comparison table and the runs table show."""

from __future__ import annotations

import math

import numpy as np

from monim.core.numbers import rounded
from monim.evaluation.evaluate import combine

# what a run achieved over its days so far, logged each day as the runs table's columns (the row's key + "_so_far")
SO_FAR = ("ppl", "ppl_novel", "accuracy", "seconds_learn", "seconds_score_per_1k", "lm_tokens_per_token")


def summarize(rows: list[dict]) -> dict:
    """A run's totals: MemRate, test PPL (all tokens, novel articles) and accuracy over all its days,
    entries, bytes, learning seconds per day, and scoring seconds per 1,000 test tokens (Θ's evaluation
    beyond the LM's pass over the test text, which the feature store holds; In-Context RALM's own
    passes included) with the LM tokens read per scored token."""
    seen = sum(r.get("tokens_seen", 0) for r in rows)
    last = rows[-1] if rows else {}
    tests = combine(rows)
    n = tests["tokens"]
    return {
        "days": len(rows), "test_tokens": n, "ppl": tests["ppl"], "ppl_novel": tests["ppl_novel"], "ppl_lm": tests["ppl_lm"],
        "accuracy": tests["accuracy"], "tokens_seen": seen, "entries": last.get("entries", 0),
        "memrate": last.get("entries", 0) / seen if seen else 0.0, "bytes": last.get("memory_bytes", 0),
        "seconds_per_day": float(np.mean([r["seconds_learn"] for r in rows if "seconds_learn" in r] or [math.nan])),
        "seconds_learn": sum(r.get("seconds_learn", 0.0) for r in rows),
        "seconds_score_per_1k": 1000 * sum(r.get("evaluate_seconds", 0.0) for r in rows) / n if n else math.nan,
        "lm_tokens_per_token": sum(r.get("lm_tokens_per_token", 1.0) * r.get("tokens", 0) for r in rows) / n if n else 1.0,
    }


def so_far(rows: list[dict]) -> dict:
    """The run's totals over these days, as the runs table shows them (at the terminal's digits)."""
    s = summarize(rows)
    shown = {"memrate_percent": round(100 * s["memrate"], 1), "memory_mb": rounded(s["bytes"] / 2**20)}  # 55.0%, 19.65 MB
    return {f"{k}_so_far": rounded(s[k]) for k in SO_FAR} | shown
