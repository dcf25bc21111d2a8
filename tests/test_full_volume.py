"""`monim bench full-volume` (benchmarks/full_volume.py), the claims' long runs: a stopped suite goes on from its kept parts."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # reads the shared data

REPO = Path(__file__).resolve().parents[1]
DAYS = ("1987-03-27", "1987-04-01")  # two ISO weeks and two months: the matrix and the quiz have two parts each
LATER = "1987-05-04"  # a question past what is learned: asked with --qa-end (Table 7's upper triangle)
QA_END = ("--qa-end", "1987-05-31")


def test_a_stopped_suite_measures_only_its_missing_parts(data_dir, tiny_model_dir, tmp_path):
    """The suite resumed from a part file keeps every part it finds (a planted value stays) and
    measures the missing ones to the values of the uninterrupted suite; stopped before a part, it
    writes nothing."""
    source, quiz = tmp_path / "news.jsonl", tmp_path / "quiz.jsonl"
    with gzip.open(data_dir / "news" / "reuters21578.jsonl.gz", "rt") as f:
        records = [r for r in map(json.loads, f) if r["date"] in DAYS]
    source.write_text("".join(json.dumps(r) + "\n" for d in DAYS for r in [x for x in records if x["date"] == d][:8]))
    quiz.write_text("".join(json.dumps({"id": f"q{i}", "date": d, "question": f"Which market moved on {d}?",
                                        "choices": ["cocoa", "oil", "grain"], "answer": [i % 3], "source": "test"}) + "\n"
                            for i, d in enumerate(DAYS * 2 + (LATER,))))
    work = tmp_path / "work"

    def full_volume(*extra: str) -> subprocess.CompletedProcess:
        args = ["--source", source, "--start", DAYS[0], "--end", DAYS[1], "--period", "week", "--workdir", work,
                "--model", tiny_model_dir("gpt2"), "--policies", "monim-amt,fullmem", "--qa", quiz,
                "--text", data_dir / "wikitext" / "wiki.test.raw", "--text-chars", "600", "--out", work / "result.json", *extra]
        proc = subprocess.run([sys.executable, "-m", "benchmarks.full_volume", *map(str, args)], cwd=REPO,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    full_volume()
    suite = work / f"suite-{DAYS[0]}-{DAYS[1]}.json"
    first = json.loads(suite.read_text())
    assert json.loads((work / "result.json").read_text())["result"]["suite"] == first  # the result, in its envelope
    assert sorted(first["qa"]) == ["1987-03", "1987-04"]  # by default the quiz ends a week after the last day
    full_volume(*QA_END)  # the finished suite is reopened: only the later month is measured
    whole = json.loads(suite.read_text())
    assert {k: v for k, v in whole.items() if k != "qa"} == {k: v for k, v in first.items() if k != "qa"}
    assert {m: whole["qa"][m] for m in first["qa"]} == first["qa"]
    (w13, w14), months = whole["periods"], sorted(whole["qa"])
    assert list(whole["periods"][w13]["ppl"]) == [f"{n}@{d}" for n in ("monim-amt", "fullmem") for d in DAYS]
    assert months == ["1987-03", "1987-04", "1987-05"] and whole["qa"][months[2]]["bare"]["n"] == 1 and whole["text"]["tokens"] > 0

    kept = json.loads(suite.read_text())
    kept["periods"][w13]["ppl"]["fullmem@" + DAYS[0]] = 123.0  # planted: a kept part is never measured again
    del kept["periods"][w13]["ppl"]["monim-amt@" + DAYS[1]], kept["periods"][w14]
    del kept["text"]["ppl"]["fullmem@" + DAYS[1]], kept["qa"][months[1]]
    part = suite.with_suffix(".part.json")
    part.write_text(json.dumps(kept))
    suite.unlink()

    assert "stopping (resumable)" in full_volume(*QA_END, "--stop-after", "0.001").stdout
    assert not suite.exists() and json.loads(part.read_text()) == kept

    full_volume(*QA_END)
    resumed = json.loads(suite.read_text())
    assert not part.exists() and resumed["periods"][w13]["ppl"].pop("fullmem@" + DAYS[0]) == 123.0
    whole["periods"][w13]["ppl"].pop("fullmem@" + DAYS[0])
    assert resumed == whole
