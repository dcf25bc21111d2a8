"""The evaluation suite and the report through the comparison flow, read back from MLflow (SQLite)."""

import datetime as dt
import json

import pytest
from mlflow.tracking import MlflowClient

from monim.core.config import DEMO_STREAM
from monim.core.run_config import RunConfig
from monim.evaluation.evaluate import evaluate
from monim.evaluation.qa import Question, answer_questions, read_questions
from monim.evaluation.suite import period_sets
from monim.lm.model import load_lm
from monim.theta.memory import Memory

DAYS = ("1987-03-07", "1987-03-09")  # a Saturday and the next Monday: two ISO weeks
EXPERIMENT = "monim-reuters-1987-03-02_03-13"
S07, S09 = 5, 7  # their MLflow steps: days since the stream's first day, 1987-03-02


@pytest.fixture(scope="module")
def suite(prefect, tiny_model_dir, tmp_path_factory):
    from flows.compare import compare_policies

    workdir = tmp_path_factory.mktemp("suite")
    text = workdir / "general.txt"
    text.write_text("The river flows through the old town and joins the sea near the harbour. " * 8)
    qa = workdir / "quiz.jsonl"
    rows = [{"question": f"Which market moved on day {d}?", "choices": ["grain", "oil", "gold"], "answer": [i % 3],
             "date": d} for i, d in enumerate(["1987-03-01", "1987-03-07", "1987-03-09", "1987-03-16", "1987-03-17"])]
    qa.write_text("\n".join(json.dumps(r) for r in rows))
    model = str(tiny_model_dir("llama"))
    evaluation = {"period": "week", "period_docs": 2, "text": str(text), "text_every": 1, "qa": str(qa), "shots": (0, 1)}
    run = RunConfig(source=str(DEMO_STREAM), workdir=str(workdir), model=model, max_docs=2)
    compare_policies(run, DAYS[0], DAYS[1], ["bare", "fullmem", "monim-amt"], evaluation=evaluation)
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    runs = {r.info.run_name: r.info.run_id for r in client.search_runs([exp.experiment_id])
            if r.data.tags.get("monim.kind") != "comparison"}  # the policies' runs, not the report's
    assert set(runs) == {"bare", "fullmem", "monim-amt"}
    return workdir, model, client, runs, qa


def history(client, run_id, key):
    """A suite measure's values by step (MLflow charts the suite's measures in section 4, the 0-shot
    QA accuracy among the results the runs table shows)."""
    from tracking.charts import chart_name

    assert chart_name(key) == (f"1_results/{key}" if key == "qa_accuracy_0shot" else f"4_suite/{key}")
    return {m.step: m.value for m in client.get_metric_history(run_id, chart_name(key))}


@pytest.mark.slow
def test_period_ppl_is_logged_as_of_each_period_end(suite):
    workdir, model, client, runs, _ = suite
    lm = load_lm(model)
    sets = period_sets(str(DEMO_STREAM), dt.date(1987, 3, 7), dt.date(1987, 3, 9), "week", max_docs=2)
    assert list(sets) == ["1987-W10", "1987-W11"]
    # week 10 as of its end (03-07) and of week 11's (03-09); week 11 only as of its own end
    fullmem = runs["fullmem"]
    w10, w11 = history(client, fullmem, "ppl_period/1987-W10"), history(client, fullmem, "ppl_period/1987-W11")
    assert set(w10) == {S07, S09} and set(w11) == {S09}
    memory = Memory.open(workdir / "memories" / "fullmem", lm)
    assert w10[S07] == pytest.approx(evaluate(lm, sets["1987-W10"], memory.at(DAYS[0]))["ppl"], rel=1e-4)
    assert w11[S09] == pytest.approx(evaluate(lm, sets["1987-W11"], memory)["ppl"], rel=1e-4)
    bare = history(client, runs["bare"], "ppl_period/1987-W10")
    assert bare[S07] == bare[S09] == pytest.approx(evaluate(lm, sets["1987-W10"])["ppl_lm"], rel=1e-6)


@pytest.mark.slow
def test_forgetting_probe_and_qa_are_logged(suite):
    workdir, model, client, runs, qa = suite
    for name, run_id in runs.items():
        text = history(client, run_id, "ppl_text")
        assert set(text) == {S07, S09} and all(v > 1 for v in text.values())  # every day (text_every=1)
        assert history(client, run_id, "ppl_text_lm")[S07] == pytest.approx(history(client, runs["bare"], "ppl_text")[S07])
        # questions from the first learned day to a week after the last: 03-07, 03-09, 03-16
        assert history(client, run_id, "qa_n") == {S09: 3.0}
        for k in (0, 1):
            acc = history(client, run_id, f"qa_accuracy_{k}shot")[S09]
            low, high = history(client, run_id, f"qa_ci_low_{k}shot")[S09], history(client, run_id, f"qa_ci_high_{k}shot")[S09]
            assert acc in (0.0, 1 / 3, 2 / 3, 1.0) and low <= acc <= high
    questions = read_questions(qa, dt.date(1987, 3, 7), dt.date(1987, 3, 16))
    lm = load_lm(model)
    want = answer_questions(lm, questions, {"lm": None}, 1, read_questions(qa))["lm"]["qa_accuracy"]
    assert history(client, runs["bare"], "qa_accuracy_1shot")[S09] == pytest.approx(want)
    assert isinstance(questions[0], Question)


@pytest.mark.slow
def test_report_has_the_papers_tables(suite):
    workdir, model, client, runs, _ = suite
    report = (workdir / "report" / "report.md").read_text()
    for heading in ("Policies: test perplexity and MemRate", "Memory growth", "Forgetting matrix", "Forgetting probe",
                    "Multiple-choice QA"):
        assert f"## {heading}" in report
    assert "| fullmem | 2 | 100.0% |" in report and "after 1987-03-07" in report and "1987-W11" in report
    for png in ("memory_growth.png", "forgetting_matrix.png", "forgetting_probe.png", "qa.png"):
        assert (workdir / "report" / png).stat().st_size > 1000


@pytest.mark.slow
def test_rerunning_the_suite_logs_nothing_twice(suite):
    from flows.evaluate import evaluate_runs
    from flows.stream import learn_stream
    from monim.core.config import EvalConfig

    workdir, model, client, runs, qa = suite
    base = RunConfig(source=str(DEMO_STREAM), workdir=str(workdir), model=model, max_docs=2)
    configs = [base.model_copy(update={"policy": p}) for p in ("bare", "fullmem")]
    weekly = EvalConfig(period="week", period_docs=2)
    assert evaluate_runs(configs, DAYS[0], DAYS[1], weekly) == {}  # all logged already
    assert len(client.get_metric_history(runs["fullmem"], "4_suite/ppl_period/1987-W10")) == 2
    # a run without the measure: only it is measured
    new = base.model_copy(update={"policy": "randmem", "rate": 0.5})
    learn_stream(new, DAYS[0], DAYS[1])
    out = evaluate_runs([*configs, new], DAYS[0], DAYS[1], weekly)
    assert set(out["periods"]["1987-W10"]) == {"randmem"}


def test_checkpoint_days():
    from monim.core.config import EvalConfig

    days = [f"2022-06-{d:02d}" for d in range(1, 16) if d != 10]  # a day without news
    at = EvalConfig(period="week", text_every=7).checkpoints(days)
    assert at["periods"] == ["2022-06-05", "2022-06-12", "2022-06-15"]  # ISO weeks end on Sundays
    assert at["text"] == ["2022-06-07", "2022-06-15"] and at["qa"] == ["2022-06-15"]  # every 7th learned day, and the last
    assert EvalConfig(period="month").checkpoints(days)["periods"] == ["2022-06-15"]


def test_the_suites_cache_key_is_a_short_file_name_for_many_runs(tmp_path):
    """Prefect stores a cached result under its key: seven runs' states and the suite's settings
    once made a name over 255 characters, and the results were not kept."""
    from types import SimpleNamespace

    from monim.core.config import EvalConfig
    from tasks.evaluation import _suite_key

    policies = ["bare", "fullmem", "monim-amt", "greedy-merge", "finetune", "mix-review", "recadam"]
    configs = [RunConfig(policy=p, workdir=str(tmp_path), review=__file__) for p in policies]
    e = EvalConfig(period="week", text=__file__, text_chars=20_000, qa=__file__)
    context = SimpleNamespace(task=SimpleNamespace(name="period_perplexity"))
    key = _suite_key(context, {"configs": configs, "days": ["2022-06-05", "2022-06-07"], "e": e})
    assert key.startswith("monim-period_perplexity-") and len(key) < 100
    assert key != _suite_key(context, {"configs": configs[:-1], "days": ["2022-06-05", "2022-06-07"], "e": e})
