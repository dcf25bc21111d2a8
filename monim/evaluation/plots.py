"""Plots of a run's days: memory growth against FullMem, and test perplexity over days."""

from __future__ import annotations

import itertools
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


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
    ax.plot(days, [r.get("ppl_lm", math.nan) for r in rows], "--", label="LM alone")  # NaN: a day without it
    ax.plot(days, [r.get("ppl", math.nan) for r in rows], "o-", label="LM + memory")
    ax.set(xlabel="day", ylabel="test PPL", title="Perplexity over days")
    ax.legend()
    fig.autofmt_xdate()
    plt.close(fig)
    return fig


def lines(title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list, list]], dashed: tuple[str, ...] = ()) -> Figure:
    """One line per labelled series of (x, y) points; the `dashed` labels drawn dashed."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, "--" if label in dashed else "o-", label=label, markersize=3)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    _whole_days(ax, series)
    ax.legend(fontsize=8)
    plt.close(fig)
    return fig


def _whole_days(ax, series: dict[str, tuple[list, list]]) -> None:
    """Ticks at whole numbers where x counts days (never "day 2.5")."""
    if all(isinstance(x, (int, float)) for xs, _ in series.values() for x in xs):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def panels(title: str, xlabel: str, ylabel: str, groups: dict[str, dict[str, tuple[list, list]]]) -> Figure:
    """Side-by-side panels (one per group) of labelled lines, sharing the y axis."""
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4), sharey=True, squeeze=False)
    for ax, (group, series) in zip(axes[0], groups.items()):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, "o-", label=label, markersize=3)
        ax.set(xlabel=xlabel, title=group)
        _whole_days(ax, series)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title)
    plt.close(fig)
    return fig


def bars(title: str, ylabel: str, groups: dict[str, dict[str, tuple[float, float, float]]]) -> Figure:
    """Grouped bars of (value, low, high) with their intervals: {group: {label: (v, low, high)}}."""
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = list(dict.fromkeys(label for g in groups.values() for label in g))
    width = 0.8 / max(len(groups), 1)
    for i, (group, values) in enumerate(groups.items()):
        xs = [j + i * width for j, label in enumerate(labels) if label in values]
        v = [values[label] for label in labels if label in values]
        ax.bar(xs, [x[0] for x in v], width, label=group,
               yerr=[[x[0] - x[1] for x in v], [x[2] - x[0] for x in v]], capsize=3)
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(labels))], labels)
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    plt.close(fig)
    return fig
