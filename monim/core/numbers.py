"""Numbers as the report and the terminal show them (and the runs table logs them)."""

from __future__ import annotations

import math

SIGNIFICANT, WHOLE_FROM = 4, 1000  # the digits a number is shown with: 4 significant, whole from a thousand


def shown(value, key: str = "") -> str:
    """A number as the report and the terminal show it: MemRate as a percent, other floats to 4
    digits, trailing zeros kept so a column's numbers line up (18.90 beside 19.21), thousands whole."""
    if key in ("memrate", "MemRate") and isinstance(value, (int, float)):
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= WHOLE_FROM else f"{value:#.{SIGNIFICANT}g}"
    return str(value)


def rounded(value: float) -> float:
    """A float at the digits `shown` writes (4 significant, thousands whole), for tables that show all they get."""
    if not isinstance(value, float) or not math.isfinite(value):
        return value
    return float(round(value)) if abs(value) >= WHOLE_FROM else float(f"{value:.{SIGNIFICANT}g}")
