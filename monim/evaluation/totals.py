"""A run's running totals over its days: what the comparison table and the runs table show."""

from __future__ import annotations

import math

import numpy as np

from monim.core.numbers import rounded

PER_TOKEN = ("ppl_lm", "ppl", "accuracy_lm", "accuracy", "skipped")  # means over all tokens
PER_NOVEL_TOKEN = ("ppl_lm_novel", "ppl_novel")  # over the tokens of articles without a twin in memory

# what a run achieved over its days so far, logged each day as the runs table's columns (the row's key + "_so_far")
SO_FAR = ("ppl", "ppl_novel", "accuracy", "seconds_learn", "seconds_score_per_1k", "lm_tokens_per_token")


def nothing_scored() -> dict:
    """An evaluation of no token: 0 tokens, every mean NaN."""
    return {k: 0 if k == "tokens" else math.nan for k in (*PER_TOKEN, *PER_NOVEL_TOKEN, "tokens", "twin_share")}


def combine(results: list[dict]) -> dict:
    """Several evaluations as one: token-weighted means (geometric for perplexities)."""
    results = [r for r in results if r.get("tokens")]
    n = sum(r["tokens"] for r in results)
    if not n:
        return nothing_scored()
    out = {"tokens": n, "twin_share": sum(r.get("twin_share", 0.0) * r["tokens"] for r in results) / n}
    for key in ("ppl_lm", "ppl"):
        out[key] = math.exp(sum(math.log(r[key]) * r["tokens"] for r in results) / n)
    for key in ("accuracy_lm", "accuracy", "skipped"):
        out[key] = sum(r.get(key, 0.0) * r["tokens"] for r in results) / n
    novel = [(r["tokens"] * (1 - r.get("twin_share", 0.0)), r) for r in results
             if not math.isnan(r.get("ppl_novel", math.nan))]
    n_novel = sum(w for w, _ in novel)
    for key in PER_NOVEL_TOKEN:
        out[key] = math.exp(sum(math.log(r[key]) * w for w, r in novel if w) / n_novel) if n_novel else math.nan
    return out


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
