"""The paper's growth claim across streams: each memory's entries against the training tokens it has
seen (log-log, one line per stream and policy), the growth exponent with its 95% interval, and how
MoNIM's daily MemRate moves after day 1 (where Θ is the bare LM) with the days learned, the day's
redundancy (twin shares) and the rate the LM alone would store at.
Reads the rows.json of `benchmarks/full_volume.py` runs (or `memory_cost.py`'s JSON).
Usage: python benchmarks/claims.py --rows Reuters=DIR/rows.json RTQA=benchmarks/results/memory-cost.json --out docs/results/claims
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.ticker  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import scipy.stats  # noqa: E402

from full_volume import growth_exponent, label  # noqa: E402  (benchmarks/ is on the path when run as a script)

COLOURS = {"fullmem": "tab:blue", "randmem": "tab:orange", "monim-amt": "tab:green"}


def read_rows(path: Path) -> list[dict]:
    """Days in date order, from full_volume.py's rows.json ({date: row}) or memory_cost.py's JSON ({"days": [...]})."""
    data = json.loads(path.read_text())
    rows = data["days"] if "days" in data else [data[d] for d in sorted(data)]
    return [r for r in rows if r["runs"].get("fullmem", {}).get("tokens")]


def correlation(x: list[float], y: list[float]) -> str:
    """Pearson's r with its two-sided p, as text ('n/a' below 3 days)."""
    if len(x) < 3 or np.std(x) == 0:
        return "n/a"
    r, p = scipy.stats.pearsonr(x, y)
    return f"r = {r:+.2f} (p = {p:.2g})"


def trend(x: np.ndarray, y: list[float]) -> str:
    """The least-squares slope of y on x in percentage points, with its 95% t interval."""
    if len(x) < 3:
        return "n/a"
    fit = scipy.stats.linregress(x, y)
    half = scipy.stats.t.ppf(0.975, len(x) - 2) * fit.stderr
    return f"{100 * fit.slope:+.1f} pp ({100 * (fit.slope - half):+.1f} to {100 * (fit.slope + half):+.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", required=True, help="STREAM=PATH to a rows.json")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    streams = {s.split("=", 1)[0]: read_rows(Path(s.split("=", 1)[1])) for s in args.rows}
    fig, (ax, rates) = plt.subplots(1, 2, figsize=(13, 4.5))
    lines = ["| stream | days | training tokens | memory | entries | MemRate | growth exponent (95% CI) |", "|---|---|---|---|---|---|---|"]
    for (stream, rows), style in zip(streams.items(), ("-", "--", ":")):
        seen = np.cumsum([r["runs"]["fullmem"]["tokens"] for r in rows])
        for name in (n for n in COLOURS if n in rows[0]["runs"]):
            entries = [r["runs"][name]["entries"] for r in rows]
            b, lo, hi = growth_exponent(rows, name)
            ax.plot(seen, entries, style, marker=".", color=COLOURS[name], label=f"{stream} {label(name)} (b = {b:.3f})")
            if name == "monim-amt":
                rates.plot(seen, [r["runs"][name]["memrate_day"] for r in rows], style, marker=".", color=COLOURS[name],
                           label=f"{stream}: MoNIM-AMT's day")
                if "memrate_lm" in rows[0]["runs"][name]:
                    rates.plot(seen, [r["runs"][name]["memrate_lm"] for r in rows], style, marker=".", color="grey",
                               label=f"{stream}: the LM alone would store")
            lines.append(f"| {stream} | {len(rows)} | {seen[-1]:,} | {label(name)} | {entries[-1]:,} | "
                         f"{entries[-1] / seen[-1]:.1%} | {b:.3f} ({lo:.3f}–{hi:.3f}) |")
    ax.set(xscale="log", yscale="log", xlabel="training tokens seen", ylabel="entries in memory",
           title="Memory growth: entries ∝ tokens^b (b < 1: sub-linear)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    rates.set(xscale="log", xlabel="training tokens seen", ylabel="MemRate of the day", title="MoNIM-AMT's daily MemRate")
    rates.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    rates.grid(True, alpha=0.3)
    rates.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "growth.png", dpi=120)
    lines += ["", "| stream | MoNIM's MemRate, day 1 (Θ = the LM) | after day 1: mean (range) | trend from day 2, per 1M tokens "
              "seen (95% CI) | the LM alone would store, after day 1 | r with the twins in memory | r with the same day's twins | "
              "r with the LM-alone rate |", "|---|---|---|---|---|---|---|---|"]
    for stream, rows in streams.items():
        rate = [r["runs"]["monim-amt"]["memrate_day"] for r in rows]
        later = rows[1:]
        before = np.cumsum([r["runs"]["fullmem"]["tokens"] for r in rows])[:-1] / 1e6
        cells = [f"{rate[0]:.1%}", f"{np.mean(rate[1:]):.1%} ({min(rate[1:]):.1%}–{max(rate[1:]):.1%})", trend(before, rate[1:])]
        lm_alone = [r["runs"]["monim-amt"].get("memrate_lm") for r in later]
        cells.append(f"{np.mean(lm_alone):.1%}" if None not in lm_alone else "n/a")
        for key in ("twin_share_train", "same_day_twin_share"):
            cells.append(correlation([r[key] for r in later], rate[1:]) if key in rows[0] else "n/a")
        cells.append(correlation(lm_alone, rate[1:]) if None not in lm_alone else "n/a")
        lines.append(f"| {stream} | " + " | ".join(cells) + " |")
    (args.out / "growth.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out / 'growth.png'}, {args.out / 'growth.md'}")


if __name__ == "__main__":
    main()
