"""The `monim` console script, run as a user runs it."""

import json
import math
import subprocess
import sys
from pathlib import Path

MONIM = str(Path(sys.executable).parent / "monim")


def test_run_scores_the_bundled_stream_with_the_default_lm():
    out = subprocess.run([MONIM, "run", "--days", "2", "--max-docs", "1", "--json"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["model"] == "smollm2-135m"
    assert [d["date"] for d in result["days"]] == ["1987-03-02", "1987-03-03"]
    for day in result["days"]:
        assert day["train_docs"] == 1 and day["test_docs"] >= 1 and day["test_tokens"] > 100
        assert 5 < day["test_ppl"] < 100 and math.isfinite(day["train_ppl"])
    assert "1987-03-02" in out  # the table


def test_help_is_fast_and_lists_run():
    out = subprocess.run([MONIM, "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "run" in out
