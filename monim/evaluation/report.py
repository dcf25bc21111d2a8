"""The paper's tables for the runs at hand: markdown plus PNGs, from each run's logged metrics.

A run is {"tags", "params", "metrics": {name: [(step, value), ...]}} (step = day index from the
run's `monim.origin` tag), whatever tracker it was read from.
"""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path

import numpy as np

from monim.core.catalogue import shown_order
from monim.core.numbers import shown
from monim.evaluation.plots import bars, lines, panels
from monim.evaluation.totals import summarize

DAILY = ("tokens", "ppl", "ppl_lm", "accuracy", "tokens_seen", "entries", "memrate", "memory_bytes", "seconds_learn",
         "ppl_novel", "ppl_lm_novel", "twin_share", "evaluate_seconds", "lm_tokens_per_token")


def day_rows(run: dict) -> list[dict]:
    """The run's days (the steps with a test PPL) as rows of their daily metrics."""
    steps = sorted({s for s, _ in run["metrics"].get("ppl", [])})
    rows = {s: {"step": s} for s in steps}
    for key in DAILY:
        for s, v in run["metrics"].get(key, []):
            if s in rows:
                rows[s][key] = v
    return [rows[s] for s in steps]


def _date(run: dict, step: int) -> str:
    origin = run["tags"].get("monim.origin")
    return (dt.date.fromisoformat(origin) + dt.timedelta(days=step)).isoformat() if origin else f"day {step}"


def _ordered(runs: dict) -> list[str]:
    return shown_order(list(runs))


def _table(header: list[str], rows: list[list]) -> str:
    lines_ = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines_ + ["| " + " | ".join(shown(v, h) for h, v in zip(header, r)) + " |" for r in rows])


def policies_table(runs: dict) -> str:
    """The runs side by side: what each achieved over its days and what it cost (the report's first table)."""
    rows = []
    for name in _ordered(runs):
        days = day_rows(runs[name])
        if not days:
            continue
        s = summarize(days)
        memory = any("entries" in r for r in days)  # a parametric learner keeps weights, not entries
        qa = {k: v[-1][1] for k, v in runs[name]["metrics"].items() if k.startswith("qa_") and k.endswith("_0shot")}
        rows.append([name, s["days"], s["memrate"] if memory else "–", int(s["entries"]) if memory else "–",
                     s["ppl"], s["ppl_novel"], s["ppl_lm"], f"{100 * (s['ppl'] / s['ppl_lm'] - 1):+.1f}%", s["accuracy"],
                     f"{100 * qa['qa_accuracy_0shot']:.1f}% [{100 * qa['qa_ci_low_0shot']:.1f}, "
                     f"{100 * qa['qa_ci_high_0shot']:.1f}]" if "qa_accuracy_0shot" in qa else "–",
                     s["bytes"] / 2**20, s["seconds_per_day"], s["seconds_score_per_1k"], s["lm_tokens_per_token"]])
    return _table(["policy", "days", "MemRate", "entries", "test PPL", "PPL, novel articles", "LM alone", "change",
                   "next-word acc.", "QA 0-shot [95%]", "MB", "learning s/day", "scoring s/1k tokens", "LM tokens/token"],
                  rows)


def _growth(runs: dict, out: Path) -> str | None:
    series, text = {}, []
    for name in _ordered(runs):
        days = day_rows(runs[name])
        if not days or "entries" not in days[0]:
            continue
        series[name] = ([r["step"] for r in days], [r["entries"] for r in days])
    monim = next((n for n in ("monim-amt", "monim") if n in series), None)
    if not series:
        return None
    if monim and len(series[monim][0]) > 7:
        xs, ys = series[monim]
        slope, icept = np.polyfit(xs[:7], ys[:7], 1)
        series[f"{monim}, first week extrapolated"] = ([xs[0], xs[-1]], [slope * xs[0] + icept, slope * xs[-1] + icept])
        rates = [r["memrate"] for r in day_rows(runs[monim])]
        text.append(f"{monim}: {ys[-1]:,.0f} entries after {len(xs)} days against {slope * xs[-1] + icept:,.0f} on its "
                    f"first week's line ({100 * (ys[-1] / (slope * xs[-1] + icept) - 1):+.1f}%); daily MemRate "
                    f"{100 * np.mean(rates[:7]):.1f}% in the first week, {100 * np.mean(rates[-7:]):.1f}% in the last.")
    lines("Memory growth", "day", "entries", series, dashed=tuple(k for k in series if "extrapolated" in k)).savefig(
        out / "memory_growth.png", dpi=100, bbox_inches="tight")
    return "\n".join(["![memory growth](memory_growth.png)", "", *text])


def _matrix(runs: dict, out: Path) -> str | None:
    periods = sorted({k.split("/", 1)[1] for r in runs.values() for k in r["metrics"] if k.startswith("ppl_period/")})
    if not periods:
        return None
    parts, groups = [], {}
    for name in _ordered(runs):
        metrics = runs[name]["metrics"]
        steps = sorted({s for p in periods for s, _ in metrics.get(f"ppl_period/{p}", [])})
        if not steps:
            continue
        cells = {p: dict(metrics.get(f"ppl_period/{p}", [])) for p in periods}
        rows = [[f"after {_date(runs[name], s)}"] + [cells[p].get(s, "") for p in periods] for s in steps]
        parts += [f"**{name}**", "", _table(["memory as of", *periods], rows), ""]
        if name != "bare":
            groups[name] = {p: (list(cells[p]), list(cells[p].values())) for p in periods if cells[p]}
    if groups:
        panels("PPL on each period's test set as learning goes on", "day", "PPL", groups).savefig(
            out / "forgetting_matrix.png", dpi=100, bbox_inches="tight")
        parts.append("![forgetting matrix](forgetting_matrix.png)")
    return "\n".join(parts)


def _text_probe(runs: dict, out: Path) -> str | None:
    have = [n for n in _ordered(runs) if runs[n]["metrics"].get("ppl_text")]
    if not have:
        return None
    steps = sorted({s for n in have for s, _ in runs[n]["metrics"]["ppl_text"]})
    values = {n: dict(runs[n]["metrics"]["ppl_text"]) for n in have}
    lm = dict(runs[have[0]]["metrics"].get("ppl_text_lm", []))
    rows = [[_date(runs[have[0]], s), lm.get(s, "")] + [values[n].get(s, "") for n in have] for s in steps]
    series = {n: (list(values[n]), list(values[n].values())) for n in have if n != "bare"}
    series["LM alone"] = (list(lm), list(lm.values()))
    lines("Forgetting probe: PPL on general-domain text", "day", "PPL", series, dashed=("LM alone",)).savefig(
        out / "forgetting_probe.png", dpi=100, bbox_inches="tight")
    return "\n".join([_table(["memory as of", "LM alone", *have], rows), "", "![forgetting probe](forgetting_probe.png)"])


def _qa(runs: dict, out: Path) -> str | None:
    keys = sorted({k for r in runs.values() for k in r["metrics"] if k.startswith("qa_accuracy_")},
                  key=lambda k: int(k.removeprefix("qa_accuracy_").removesuffix("shot")))
    if not keys:
        return None
    rows: list[list] = []
    groups: dict[str, dict[str, tuple[float, float, float]]] = {}
    for name in _ordered(runs):
        m = {k: v[-1][1] for k, v in runs[name]["metrics"].items() if k.startswith("qa_")}
        if not any(k in m for k in keys):
            continue
        row = [name, int(m.get("qa_n", 0))]
        for k in keys:
            shots = k.removeprefix("qa_accuracy_")
            low, high = m.get(f"qa_ci_low_{shots}", math.nan), m.get(f"qa_ci_high_{shots}", math.nan)
            row.append(f"{100 * m[k]:.1f}% [{100 * low:.1f}, {100 * high:.1f}]" if k in m else "")
            if k in m:
                groups.setdefault(shots.replace("shot", "-shot"), {})[name] = (m[k], low, high)
        rows.append(row)
    bars("Multiple-choice QA accuracy (95% interval)", "accuracy", groups).savefig(out / "qa.png", dpi=100,
                                                                                   bbox_inches="tight")
    header = ["policy", "questions", *(k.removeprefix("qa_accuracy_").replace("shot", "-shot") for k in keys)]
    return "\n".join([_table(header, rows), "", "![QA accuracy](qa.png)"])


def render_report(runs: dict[str, dict], out: Path | str, title: str) -> str:
    """Write the report's PNGs into `out` and return its markdown (sections without data are left out)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sections = [
        ("Policies: test perplexity and MemRate", "Token-weighted over every day's test articles, each scored "
         "with the memory (or a parametric learner's weights) as it stood after that day; novel articles: those "
         "without a near-duplicate among the articles learned. MB: what the run keeps on disk (a parametric learner: "
         "a copy of the weights per day); learning s/day: a day's learning (memorize, index, calibrate; or train) "
         "beyond the LM's pass over its text, which every policy shares; scoring s/1k tokens: the test text's "
         "scoring beyond that pass (In-Context RALM's own passes included: it reads the LM tokens/token shown).",
         policies_table(runs)),
        ("Memory growth", "", _growth(runs, out)),
        ("Forgetting matrix", "PPL on each period's test articles with the memory as of the end of that period "
         "and of each later one (read back from the same memory, no copies).", _matrix(runs, out)),
        ("Forgetting probe", "PPL on general-domain text (WikiText) as learning goes on.", _text_probe(runs, out)),
        ("Multiple-choice QA", "Accuracy with its 95% Wilson interval, by number of solved examples (shots).",
         _qa(runs, out)),
    ]
    body = [f"# {title}", ""]
    for head, note, content in sections:
        if content:
            body += [f"## {head}", "", *([note, ""] if note else []), content, ""]
    return "\n".join(body)
