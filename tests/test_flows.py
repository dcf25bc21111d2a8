"""The day, stream and comparison flows under Prefect's test harness, logging to MLflow (SQLite)."""

import datetime as dt
import hashlib
import json
import math
import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from monim.core.config import DEMO_STREAM
from monim.core.run_config import RunConfig
from monim.data.feed import open_feed
from monim.data.stream import iter_days

pytestmark = pytest.mark.slow  # runs Prefect flows

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
    days = list(iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 2), dt.date(1987, 3, 3)))
    tokens = sum(len(tok(d.text)["input_ids"]) - 1 for day in days for d in day.train[:3])
    assert summary["fullmem"]["entries"] == summary["fullmem"]["tokens_seen"] == tokens
    assert summary["fullmem"]["memrate"] == 1.0
    assert 0 < summary["monim-amt"]["entries"] < tokens
    rate = summary["monim-amt"]["memrate"]
    assert abs(summary["randmem"]["memrate"] - rate) < 0.1  # RandMem follows MoNIM's rate
    assert summary["bare"]["entries"] == 0 and summary["bare"]["ppl"] == pytest.approx(summary["bare"]["ppl_lm"])
    assert summary["bare"]["test_tokens"] == summary["fullmem"]["test_tokens"] > 0
    # the LM ran once per article for the four policies: each text is in the feature store once
    from monim.lm.features import digest

    stored = [h for meta in (workdir / "features").glob("*/*/docs.json") for h, _, _ in json.loads(meta.read_text())]
    texts = {digest(d.text) for day in days for d in (*day.train[:3], *day.validation, *day.test)}
    assert sorted(stored) == sorted(texts)


def test_a_days_flow_run_holds_the_recipes_tasks_in_order(compared):
    """The Prefect UI's view of a day: one task run per step of the recipe, named and ordered as
    flows/day.py calls them (the bare LM learns and registers nothing)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName

    workdir = compared[0]
    memory = ["ingest", "featurize", "memorize", "calibrate", "evaluate", "register_day", "log_day", "record_day"]
    expected = {"bare": ["ingest", "featurize", "evaluate", "log_day", "record_day"], "fullmem": memory, "monim-amt": memory}
    with get_client(sync_client=True) as client:
        for policy, steps in expected.items():
            names = [f"{policy}-{d}" for d in DAYS]
            flow_runs = [r for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=names)))
                         if r.parameters["cfg"]["workdir"] == str(workdir)]
            assert sorted(r.name for r in flow_runs) == names
            for flow_run in flow_runs:
                task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
                assert [t.name.rsplit("-", 1)[0] for t in sorted(task_runs, key=lambda t: t.start_time)] == steps, flow_run.name
                assert all(t.state.is_completed() for t in task_runs)


def test_mlflow_holds_every_day_of_every_policy(compared):
    workdir, model, summary = compared
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("monim-reuters-1987-03-02_03-13")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"bare", "fullmem", "randmem", "monim-amt", "comparison (report)"}
    comparison = runs.pop("comparison (report)")  # groups the policies' runs, and holds the report
    assert comparison.info.status == "FINISHED" and "report/report.md" in {
        a.path for a in client.list_artifacts(comparison.info.run_id, "report")}
    day_ms = {0: 541641600000, 1: 541728000000}  # 1987-03-02 and 1987-03-03, 00:00 UTC
    for name, run in runs.items():
        ppl = client.get_metric_history(run.info.run_id, "3_quality/ppl")
        assert [m.step for m in ppl] == [0, 1] and {m.step: m.timestamp for m in ppl} == day_ms
        # the runs table's column: PPL over every test token so far, from the days' PPL and tokens by hand
        tokens = [m.value for m in client.get_metric_history(run.info.run_id, "3_quality/tokens")]
        so_far = [m.value for m in client.get_metric_history(run.info.run_id, "1_results/ppl_so_far")]
        by_hand = [math.exp(sum(t * math.log(p.value) for t, p in zip(tokens[:n], ppl)) / sum(tokens[:n])) for n in (1, 2)]
        assert so_far == [float(round(v)) if v >= 1000 else float(f"{v:.4g}") for v in by_hand]
        assert run.data.metrics["1_results/ppl_so_far"] == so_far[-1]
        assert f"| {name} | 2 |" in comparison.data.tags["mlflow.note.content"]  # the report run's side-by-side
        assert comparison.data.metrics[f"{name}/ppl"] == so_far[-1] and comparison.data.metrics[f"{name}/days"] == 2
        assert run.data.params["policy"] == name and run.data.params["model"] == model
        assert run.data.tags["monim.comparison"] == comparison.info.run_id
        assert run.info.status == "FINISHED" and run.info.end_time >= run.info.start_time
        assert run.data.tags["mlflow.note.content"].startswith(f"**{name}** on `reuters-1987-03-02_03-13.jsonl.gz`: 2 days")
        assert "step" not in {k.rpartition("/")[2] for k in run.data.metrics}
    fullmem = runs["fullmem"]
    tokens = [m.value for m in client.get_metric_history(fullmem.info.run_id, "2_learned/tokens_seen")]
    assert sum(tokens) == summary["fullmem"]["tokens_seen"]
    assert client.get_metric_history(fullmem.info.run_id, "1_results/memrate_percent")[-1].value == 100.0
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
    assert len(client.get_metric_history(run.info.run_id, "3_quality/ppl")) == 2
    assert run.info.status == "FINISHED"  # reopened by the re-run, and ended again


def test_stream_resumes_after_the_last_learned_day(compared):
    from flows.stream import learn_stream
    from monim.data import dayindex

    workdir, model, summary = compared
    dayindex.READS.clear()
    run = RunConfig(source=str(DEMO_STREAM), policy="fullmem", workdir=str(workdir), model=model, max_docs=3)
    rows = learn_stream(run, DAYS[0], "1987-03-04")
    assert dayindex.READS[str(DEMO_STREAM)] == 2  # the last learned day (late news?), the new day once for all its tasks
    assert [r["date"] for r in rows] == [*DAYS, "1987-03-04"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert len(list((workdir / "memories" / "fullmem" / "shards").iterdir())) == 3


def test_the_daily_flow_trains_and_uses_the_calibrator(compared):
    from flows.stream import learn_stream
    from monim.lm.model import load_lm
    from monim.theta.memory import Memory

    workdir, model, summary = compared
    memory = Memory.open(workdir / "memories" / "monim-amt", load_lm(model))
    assert memory.calibrator().summary["date"] == DAYS[1]
    chain = memory.calibration_files()
    assert [p.split("/")[1][:10] for p in chain] == list(DAYS)  # one day's examples each
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("monim-reuters-1987-03-02_03-13")
    run = client.search_runs(exp.experiment_id, filter_string="attributes.run_name = 'monim-amt'")[0]
    for metric in ("5_calibration/heldout_nll_calibrator", "5_calibration/heldout_nll_lm", "5_calibration/theta_fallback",
                   "3_quality/twin_share", "8_data/docs_twin_groups"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, metric)] == [0, 1], metric
    assert run.data.params["calibrated"] == "True" and run.data.params["calibrator.groups"] == str(("distribution", "lexical", "density"))
    # constant λ is its own run and memory, named after it
    run = RunConfig(source=str(DEMO_STREAM), workdir=str(workdir), model=model, max_docs=3, calibrated=False)
    rows = learn_stream(run, DAYS[0], DAYS[1])
    assert [r["date"] for r in rows] == list(DAYS) and (workdir / "memories" / "monim-amt-const" / "manifest.json").exists()
    assert client.search_runs(exp.experiment_id, filter_string="attributes.run_name = 'monim-amt-const'")


def test_fsck_of_the_work_directory_relogs_a_day_mlflow_lost(compared):
    import sqlite3

    from cli.fsck import check_workdir

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
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "3_quality/ppl"))
    assert history == sorted((r["step"], r["ppl"]) for r in rows.values())  # each day once, with the record's value


MODEL_NAME = "monim-reuters-1987-03-02_03-13-monim-amt"


def validation_ppl(lm, root, day, as_of) -> float:
    """Θ's PPL on a day's validation articles with a memory as of a day, computed here."""
    from monim.evaluation.evaluate import evaluate
    from monim.theta.memory import Memory

    return evaluate(lm, day.validation, Memory.open(root, lm, as_of))["ppl"]


def test_each_committed_day_is_a_model_version_behind_a_champion_gate(compared):
    import os

    import mlflow

    from monim.data.feed import Document
    from monim.lm.model import load_lm
    from monim.theta.memory import Memory

    workdir, model, summary = compared
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    client, root, lm = MlflowClient(uri), workdir / "memories" / "monim-amt", load_lm(model)
    versions = sorted(client.search_model_versions(f"name = '{MODEL_NAME}'"), key=lambda v: int(v.version))
    assert [v.tags["monim.as_of"] for v in versions] == list(DAYS)  # one version a day, none added by re-runs
    assert "MLFLOW_TRACKING_URI" not in os.environ and mlflow.get_tracking_uri() != uri  # no process-wide state
    day2 = list(iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 3), dt.date(1987, 3, 3)))[0]
    new, champion = validation_ppl(lm, root, day2, DAYS[1]), validation_ppl(lm, root, day2, DAYS[0])
    assert float(versions[1].tags["gate_ppl"]) == pytest.approx(new, rel=1e-4)
    assert float(versions[1].tags["gate_ppl_champion"]) == pytest.approx(champion, rel=1e-4)
    assert str(client.get_model_version_by_alias(MODEL_NAME, "champion").version) == ("2" if new <= champion else "1")
    run = client.search_runs(client.get_experiment_by_name("monim-reuters-1987-03-02_03-13").experiment_id,
                             filter_string="attributes.run_name = 'monim-amt'")[0]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "7_registry/gate_ppl")] == pytest.approx([new])
    # a version references the memory, it holds no copy of it; loaded, it is Θ as of its day
    served = mlflow.pyfunc.load_model(client.get_model_version_download_uri(MODEL_NAME, "1"))
    assert served.model_config["memory"] == str(root.resolve()) and served.model_config["as_of"] == DAYS[0]
    assert not list((workdir / "mlartifacts").rglob("*.npy"))
    text = day2.test[0].text[:400]
    answer = served.predict([{"text": text}])[0]
    from monim.evaluation.evaluate import evaluate

    want = evaluate(lm, [Document("t", dt.date.min, text)], Memory.open(root, lm, DAYS[0]))
    assert answer["ppl"] == pytest.approx(want["ppl"], rel=1e-6) and answer["ppl_lm"] == pytest.approx(want["ppl_lm"], rel=1e-6)
    generated = served.predict([{"prompt": text[:60]}], params={"max_new_tokens": 5})[0]
    assert len(generated["tokens"]) == 5 and len(generated["lams"]) == 5


def test_a_changed_memory_is_refused(compared, tmp_path):
    import shutil

    from mlflow.exceptions import MlflowException

    from monim.storage.datastore import Datastore
    from tracking.served_model import open_memory

    workdir, model, summary = compared
    import mlflow

    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    client = MlflowClient(uri)
    config = mlflow.pyfunc.load_model(client.get_model_version_download_uri(MODEL_NAME, "2")).model_config
    copy = tmp_path / "monim-amt"
    shutil.copytree(workdir / "memories" / "monim-amt", copy)
    assert len(open_memory(uri, config | {"memory": str(copy)})) > 0  # the same memory elsewhere is the same Θ
    ds = Datastore.read(copy)
    assert ds.commits.forget(doc_ids=[ds.shards.shard_docs(ds.days[0].shard)[0]]) > 0  # a retracted article
    with pytest.raises(MlflowException, match="has changed since this model version was registered"):
        open_memory(uri, config | {"memory": str(copy)})


def test_the_champion_answers_over_http_and_bad_requests_get_a_400(compared):
    import os
    import sys
    import urllib.error
    import urllib.request

    from servers import local

    workdir, model, summary = compared
    port = local.free_port()
    cmd = [str(Path(sys.executable).parent / "mlflow"), "models", "serve", "-m", f"models:/{MODEL_NAME}@champion",
           "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port), "-w", "1"]
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}",  # and its uvicorn on PATH, as in the venv
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = local.start(cmd, f"http://127.0.0.1:{port}/ping", env=env)

    def post(body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        status, out = post({"dataframe_records": [{"text": "Oil prices rose on Monday."}, {"prompt": "The bank said"}],
                            "params": {"max_new_tokens": 4}})
        assert status == 200, out
        scored, generated = out["predictions"]
        assert scored["ppl"] > 1 and scored["tokens"] == 5 and len(generated["tokens"]) == 4
        for bad, says in (({"dataframe_records": [{"text": "  "}]}, "empty"),
                          ({"dataframe_records": [{"txt": "hello"}]}, "(to score)"),
                          ({"dataframe_records": [{"text": "x" * 20_001}]}, "at most"),
                          ({"dataframe_records": [{"text": "Oil"}]}, "single token"),
                          ({"dataframe_records": [{"prompt": "hi"}], "params": {"top_p": 0.0}}, "top_p")):
            status, out = post(bad)
            assert 400 <= status < 500 and says in out["message"], (bad, status, out)
        assert proc.poll() is None  # still serving
    finally:
        local.stop([proc])
    assert os.path.exists(workdir / "mlflow.db")


def test_promote_and_rollback_move_the_aliases_by_hand(compared):
    from tracking.champion import promote, rollback

    workdir, model, summary = compared
    uri, root = f"sqlite:///{workdir / 'mlflow.db'}", workdir / "memories" / "monim-amt"
    assert promote(uri, root, "1")["champion"] == "1"
    assert promote(uri, root) == {"model": MODEL_NAME, "champion": "2", "previous": "1"}  # default: the newest
    assert rollback(uri, root)["champion"] == "1"
    client = MlflowClient(uri)
    assert str(client.get_model_version_by_alias(MODEL_NAME, "champion").version) == "1"
    assert "previous" not in client.get_registered_model(MODEL_NAME).aliases
    versions = sorted(client.search_model_versions(f"name = '{MODEL_NAME}'"), key=lambda v: int(v.version))
    assert [v.tags["monim.as_of"] for v in versions] == list(DAYS)
    with pytest.raises(ValueError, match="no 'previous'"):
        rollback(uri, root)
    with pytest.raises(ValueError, match="no version 9"):
        promote(uri, root, "9")


def test_the_library_run_learns_a_day_as_the_flows_do(compared, tmp_path):
    """monim.run without Prefect or MLflow (the same recipe: ingest, featurize, learn, evaluate,
    record) gives the rows the flows recorded for the same run."""
    from monim.run import make_run
    from monim.storage.workdirs import read_rows

    workdir, model, _ = compared
    cfg = RunConfig(source=str(DEMO_STREAM), workdir=str(tmp_path), model=model, max_docs=3)
    run = make_run(cfg)
    by_flow = read_rows(workdir, "monim-amt")
    for step, date in enumerate(DAYS):
        row = run.day(dt.date.fromisoformat(date), step)
        assert {k: row[k] for k in ("ppl", "ppl_lm", "accuracy", "entries", "memrate", "lam", "temperature")} == \
               {k: by_flow[date][k] for k in ("ppl", "ppl_lm", "accuracy", "entries", "memrate", "lam", "temperature")}
    assert read_rows(tmp_path, "monim-amt").keys() == set(DAYS)


def test_a_range_is_read_once_however_many_policies_learn_it(prefect, tiny_model_dir, tmp_path):
    """A comparison plans every policy's range from one read of the feed, the command's check before any work
    and the flows alike (issue 67): each record of the range is read once to plan, then once by each policy's
    ingest of its day (which stops at the next day's first record); a one-policy learn the same."""
    import gzip

    from cli.plans import check_plans
    from flows.compare import compare_policies
    from flows.stream import learn_stream
    from monim.data import dayindex

    lines = [line for line in gzip.open(DEMO_STREAM, "rt") if json.loads(line)["date"] in DAYS]
    feed = tmp_path / "feed.jsonl"
    feed.write_text("".join(lines))  # the demo's first two days, and nothing after them
    n, first = len(lines), sum(json.loads(line)["date"] == DAYS[0] for line in lines)
    learned = n + 1  # each policy reads each day once: the first day up to the second's first record, then the second
    run = RunConfig(source=str(feed), workdir=str(tmp_path / "w"), model=str(tiny_model_dir("llama")), max_docs=2)
    dayindex.RECORDS.clear()
    learn_stream(run.model_copy(update={"policy": "fullmem"}), *DAYS)
    assert 0 < first < n and dayindex.RECORDS[str(feed)] == n + learned
    os.utime(feed)  # the feed changed (as far as its time says): read again
    dayindex.RECORDS.clear()
    run = run.model_copy(update={"workdir": str(tmp_path / "v")})
    check_plans(run, *DAYS, ["bare", "fullmem"])  # as `monim compare` does before any work
    compare_policies(run, *DAYS, ["bare", "fullmem"])
    assert dayindex.RECORDS[str(feed)] == n + 2 * learned
