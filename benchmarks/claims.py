"""The paper's growth claim: entries against tokens seen, the growth exponent, MoNIM's MemRate over days.

The paper's growth claim across streams: each memory's entries against the training tokens it has
seen (log-log, one line per stream and policy), the growth exponent with its 95% interval, and how
MoNIM's daily MemRate moves after day 1 (where Θ is the bare LM) with the days learned, the day's
redundancy (twin shares) and the rate the LM alone would store at.
Reads the rows.json of `monim bench full-volume` runs (or `monim bench policies --study cost`'s JSON).
Usage: monim bench claims --rows Reuters=DIR/rows.json RTQA=docs/results/policies/policies-cost.json (writes
docs/results/claims/: growth.png, growth.md and claims.json)
"""

from benchmarks.harness import parser, resume, save
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.ticker  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import scipy.stats  # noqa: E402

from benchmarks.full_volume import growth_exponent, label  # noqa: E402  

COLOURS = {"fullmem": "tab:blue", "randmem": "tab:orange", "monim-amt": "tab:green"}


def read_rows(path: Path) -> list[dict]:
    """Days in date order, from a full-volume work directory's rows.json ({date: row}), its result JSON
    ({"rows": [...]}) or `monim bench policies --study cost`'s ({"days": [...]}), in an envelope or not."""
    data = resume(path, {})
    rows = data["days"] if "days" in data else data["rows"] if "rows" in data else [data[d] for d in sorted(data)]
    return [r for r in rows if r["runs"].get("fullmem", {}).get("tokens")]


def correlation(x: list[float], y: list[float]) -> str:
    """Pearson's r with its two-sided p, as text ('n/a' below 3 days)."""
    if len(x) < 3 or np.std(x) == 0:
        return "n/a"
    r, p = scipy.stats.pearsonr(x, y)
    return f"r = {r:+.2f} (p = {p:.2g})"


def trend(y: list[float], weights: list[float], x: np.ndarray, *controls: list[float]) -> str:
    """The slope of y on x in percentage points with its 95% t interval, by least squares weighted by
    `weights` (a day's tokens: a small day's rate is noisy), with `controls` held fixed."""
    X = np.column_stack([np.ones(len(x)), x, *controls])
    if len(x) <= X.shape[1]:
        return "n/a"
    w = np.sqrt(np.asarray(weights, float))
    Xw, yw = X * w[:, None], np.asarray(y) * w
    coef, *_ = np.linalg.lstsq(Xw, yw, rcond=None)
    resid = yw - Xw @ coef
    dof = len(x) - X.shape[1]
    se = np.sqrt(resid @ resid / dof * np.linalg.inv(Xw.T @ Xw)[1, 1])
    half = scipy.stats.t.ppf(0.975, dof) * se
    return f"{100 * coef[1]:+.1f} pp ({100 * (coef[1] - half):+.1f} to {100 * (coef[1] + half):+.1f})"


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "claims")
    ap.add_argument("--rows", nargs="+", required=True, help="RTQA=PATH to a rows.json")
    args = ap.parse_args(argv)
    figures = args.out.parent  # growth.png and growth.md beside the result JSON
    figures.mkdir(parents=True, exist_ok=True)
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
    fig.savefig(figures / "growth.png", dpi=120)
    lines += ["", "| stream | MoNIM's MemRate, day 1 (Θ = the LM) | after day 1: mean (range) | trend from day 2, per 1M tokens "
              "seen (95% CI) | the same, twin shares held fixed | the LM alone would store, after day 1 | the memory's effect "
              "(LM alone − MemRate): trend | r with the twins in memory | r with the same day's twins | r with the LM-alone rate |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for stream, rows in streams.items():
        rate = [r["runs"]["monim-amt"]["memrate_day"] for r in rows]
        later = rows[1:]
        before = np.cumsum([r["runs"]["fullmem"]["tokens"] for r in rows])[:-1] / 1e6
        tokens = [r["runs"]["monim-amt"]["tokens"] for r in later]
        twins = [[r[key] for r in later] for key in ("twin_share_train", "same_day_twin_share") if key in rows[0]]
        lm_alone = [r["runs"]["monim-amt"].get("memrate_lm") for r in later]
        known = None not in lm_alone
        cells = [f"{rate[0]:.1%}", f"{np.mean(rate[1:]):.1%} ({min(rate[1:]):.1%}–{max(rate[1:]):.1%})",
                 trend(rate[1:], tokens, before), trend(rate[1:], tokens, before, *twins) if twins else "n/a",
                 f"{np.mean(lm_alone):.1%}" if known else "n/a",
                 trend(list(np.subtract(lm_alone, rate[1:])), tokens, before) if known else "n/a"]
        cells += [correlation(t, rate[1:]) for t in twins] or ["n/a", "n/a"]
        cells.append(correlation(lm_alone, rate[1:]) if known else "n/a")
        lines.append(f"| {stream} | " + " | ".join(cells) + " |")
    (figures / "growth.md").write_text("\n".join(lines) + "\n")
    save(args.out, {"tables": lines}, args)
    print("\n".join(lines))
    print(f"wrote {figures / 'growth.png'}, {figures / 'growth.md'}, {args.out}")


if __name__ == "__main__":
    main()
