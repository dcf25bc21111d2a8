"""Plots of a run's days: memory growth against FullMem, and test perplexity over days."""

from __future__ import annotations

import itertools

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402


def memory_growth(rows: list[dict]) -> Figure:
    """Entries in memory per day, against what FullMem would hold (every token seen)."""
    days = [r["date"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(days, list(itertools.accumulate(r.get("tokens_seen", 0) for r in rows)), "--", label="FullMem (all tokens)")
    ax.plot(days, [r.get("entries", 0) for r in rows], "o-", label=rows[0].get("policy", "memory"))
    ax.set(xlabel="day", ylabel="entries", title="Memory growth")
    ax.legend()
    fig.autofmt_xdate()
    plt.close(fig)
    return fig


def ppl_over_days(rows: list[dict]) -> Figure:
    """Test perplexity of each day's articles: LM alone and LM + memory."""
    days = [r["date"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(days, [r.get("ppl_lm") for r in rows], "--", label="LM alone")
    ax.plot(days, [r.get("ppl") for r in rows], "o-", label="LM + memory")
    ax.set(xlabel="day", ylabel="test PPL", title="Perplexity over days")
    ax.legend()
    fig.autofmt_xdate()
    plt.close(fig)
    return fig
