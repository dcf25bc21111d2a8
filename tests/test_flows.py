"""The day, stream and comparison flows under Prefect's test harness, logging to MLflow (SQLite)."""

import datetime as dt
import hashlib
import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from monim.config import RunConfig
from monim.stream import DEMO_STREAM, iter_days, open_source

DAYS = ("1987-03-02", "1987-03-03")


def tree_digest(root: Path) -> str:
    """A hash of every file's path and bytes under root (the memory as stored)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def compared(prefect, tiny_model_dir, tmp_path_factory):
    from flows.compare import compare_policies

    workdir = tmp_path_factory.mktemp("work")
    model = str(tiny_model_dir("llama"))
    run = RunConfig(source=str(DEMO_STREAM), workdir=str(workdir), model=model, max_docs=3)
    summary = compare_policies(run, DAYS[0], DAYS[1], ["bare", "fullmem", "randmem", "monim-amt"])
    return workdir, model, summary


def test_memories_hold_what_each_policy_stores(compared, tiny_model_dir):
    from transformers import AutoTokenizer

    workdir, model, summary = compared
    tok = AutoTokenizer.from_pretrained(model)
    days = list(iter_days(open_source(DEMO_STREAM), dt.date(1987, 3, 2), dt.date(1987, 3, 3)))
    tokens = sum(len(tok(d.text)["input_ids"]) - 1 for day in days for d in day.train[:3])
    assert summary["fullmem"]["entries"] == summary["fullmem"]["tokens_seen"] == tokens
    assert summary["fullmem"]["memrate"] == 1.0
    assert 0 < summary["monim-amt"]["entries"] < tokens
    rate = summary["monim-amt"]["memrate"]
    assert abs(summary["randmem"]["memrate"] - rate) < 0.1  # RandMem follows MoNIM's rate
    assert summary["bare"]["entries"] == 0 and summary["bare"]["ppl"] == pytest.approx(summary["bare"]["ppl_lm"])
    assert summary["bare"]["test_tokens"] == summary["fullmem"]["test_tokens"] > 0
    # the LM ran once per article for the four policies: each text is in the feature store once
    from monim.features import digest

    stored = [h for meta in (workdir / "features").glob("*/*/docs.json") for h, _, _ in json.loads(meta.read_text())]
    texts = {digest(d.text) for day in days for d in (*day.train[:3], *day.validation, *day.test)}
    assert sorted(stored) == sorted(texts)


def test_mlflow_holds_every_day_of_every_policy(compared):
    workdir, model, summary = compared
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("monim-reuters-1987-03-02_03-13")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"bare", "fullmem", "randmem", "monim-amt"}
    for name, run in runs.items():
        assert [m.step for m in client.get_metric_history(run.info.run_id, "ppl")] == [0, 1]
        assert run.data.params["policy"] == name and run.data.params["model"] == model
    fullmem = runs["fullmem"]
    tokens = [m.value for m in client.get_metric_history(fullmem.info.run_id, "tokens_seen")]
    assert sum(tokens) == summary["fullmem"]["tokens_seen"]
    assert client.get_metric_history(fullmem.info.run_id, "memrate")[-1].value == 1.0
    assert runs["randmem"].data.params["policy.rate"] == str(round(summary["monim-amt"]["memrate"], 4))
    artifacts = {a.path for a in client.list_artifacts(fullmem.info.run_id)}
    assert {"config.json", "days.csv", "plots"} <= artifacts
    assert {a.path for a in client.list_artifacts(fullmem.info.run_id, "plots")} == {"plots/memory_growth.png", "plots/ppl.png"}


def test_rerunning_the_stream_changes_nothing(compared):
    from flows.stream import learn_stream

    workdir, model, summary = compared
    memory = workdir / "memories" / "monim-amt"
    before = tree_digest(memory)
    # a dict, as a deployment or the Prefect UI's form passes it, is validated into the RunConfig
    run = {"source": str(DEMO_STREAM), "workdir": str(workdir), "model": model, "max_docs": 3}
    rows = learn_stream(run, DAYS[0], DAYS[1])
    assert [r["date"] for r in rows] == list(DAYS)
    assert tree_digest(memory) == before
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    run = client.search_runs(client.get_experiment_by_name("monim-reuters-1987-03-02_03-13").experiment_id,
                             filter_string="attributes.run_name = 'monim-amt'")[0]
    assert len(client.get_metric_history(run.info.run_id, "ppl")) == 2


def test_stream_resumes_after_the_last_learned_day(compared):
    from flows.stream import learn_stream
    from monim import dayindex

    workdir, model, summary = compared
    dayindex.READS.clear()
    run = RunConfig(source=str(DEMO_STREAM), policy="fullmem", workdir=str(workdir), model=model, max_docs=3)
    rows = learn_stream(run, DAYS[0], "1987-03-04")
    assert dayindex.READS[str(DEMO_STREAM)] == 1  # the one new day, read once for all its tasks
    assert [r["date"] for r in rows] == [*DAYS, "1987-03-04"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert len(list((workdir / "memories" / "fullmem" / "shards").iterdir())) == 3


def test_the_daily_flow_trains_and_uses_the_calibrator(compared):
    from flows.stream import learn_stream
    from monim.lm import load_lm
    from monim.memory import Memory

    workdir, model, summary = compared
    memory = Memory(workdir / "memories" / "monim-amt", load_lm(model))
    assert memory.calibrator().record["date"] == DAYS[1]
    chain = memory.calibration_files()
    assert [p.split("/")[1][:10] for p in chain] == list(DAYS)  # one day's examples each
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("monim-reuters-1987-03-02_03-13")
    run = client.search_runs(exp.experiment_id, filter_string="attributes.run_name = 'monim-amt'")[0]
    for metric in ("heldout_nll_calibrator", "heldout_nll_lm", "theta_fallback", "twin_share", "docs_twin_groups"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, metric)] == [0, 1], metric
    assert run.data.params["calibrated"] == "True" and run.data.params["calibrator.groups"] == str(("distribution", "lexical", "density"))
    # constant λ is its own run and memory, named after it
    run = RunConfig(source=str(DEMO_STREAM), workdir=str(workdir), model=model, max_docs=3, calibrated=False)
    rows = learn_stream(run, DAYS[0], DAYS[1])
    assert [r["date"] for r in rows] == list(DAYS) and (workdir / "memories" / "monim-amt-const" / "manifest.json").exists()
    assert client.search_runs(exp.experiment_id, filter_string="attributes.run_name = 'monim-amt-const'")


def test_fsck_of_the_work_directory_relogs_a_day_mlflow_lost(compared):
    import sqlite3

    from flows.fsck import check_workdir

    workdir, model, summary = compared
    assert check_workdir(str(workdir)) == []
    with sqlite3.connect(workdir / "mlflow.db") as db:  # MLflow loses day 1 of every run (e.g. a failed upload)
        db.execute("DELETE FROM metrics WHERE step = 1")
        db.execute("DELETE FROM latest_metrics WHERE step = 1")
    problems = check_workdir(str(workdir))
    assert len(problems) == len(list((workdir / "runs").glob("*.json"))) and all("days 1987-03-03 not logged" in p["what"] and not p["repaired"] for p in problems)
    assert all(p["repaired"] for p in check_workdir(str(workdir), repair=True))
    assert check_workdir(str(workdir)) == []
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("monim-reuters-1987-03-02_03-13")
    run = client.search_runs(exp.experiment_id, filter_string="attributes.run_name = 'fullmem'")[0]
    rows = json.loads((workdir / "runs" / "fullmem.json").read_text())
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "ppl"))
    assert history == sorted((r["step"], r["ppl"]) for r in rows.values())  # each day once, with the record's value
