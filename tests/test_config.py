"""The typed run cfg: what a deployment or the Prefect UI's form may pass, and what it may not."""

import datetime as dt
import os

import pytest
from pydantic import ValidationError

from monim.core.config import EvalConfig
from monim.core.run_config import RunConfig
from monim.storage.workdirs import memory_root
from tracking.runs import run_params


@pytest.mark.parametrize("fields, where", [
    ({"polcy": "fullmem"}, "polcy"),  # a typo is an error, not a silently ignored setting
    ({"context_mode": "sliding"}, "context_mode"),
    ({"dtype": "fp8"}, "dtype"),
    ({"max_docs": 0}, "max_docs"),
    ({"policy": "lru"}, "unknown policy 'lru'"),
    ({"policy": "randmem", "rate": 1.5}, "rate"),
    ({"delta": 0.5}, "delta"),
    ({"calibrator": {"epochz": 3}}, "calibrator"),
])
def test_bad_settings_name_the_field(fields, where):
    with pytest.raises(ValidationError, match=where):
        RunConfig(**fields)


def test_the_spec_round_trips_through_json_and_names_its_run():
    run = RunConfig(policy="monim-amt", calibrated=False, delta=-2.0, max_docs=8)
    again = RunConfig.model_validate_json(run.model_dump_json())
    assert again == run and again.fingerprint() == run.fingerprint()
    assert run.name == "monim-amt-const" and str(memory_root(run.workdir, run.name)).endswith("memories/monim-amt-const")
    assert RunConfig(policy="bare", calibrated=False).name == "bare"
    assert run.fingerprint() != run.model_copy(update={"max_docs": 9}).fingerprint()
    assert run_params(run)["policy.delta"] == -2.0 and "delta" not in run_params(run)


def test_flows_show_the_spec_as_a_form():
    """Prefect's parameter schema (the UI's form) lists every RunConfig field with its description."""
    from prefect.utilities.callables import parameter_schema

    from flows.compare import compare_policies
    from flows.stream import learn_stream, learn_yesterday

    for flow in (learn_stream, learn_yesterday, compare_policies):
        schema = parameter_schema(flow).model_dump_for_openapi()
        definitions = schema["definitions"]
        fields = definitions["RunConfig"]["properties"]
        assert set(fields) == set(RunConfig.model_fields), flow.name
        assert "bare: the LM alone; fullmem: " in fields["policy"]["description"]
        assert "EvalConfig" in definitions, flow.name


def test_evaluation_settings_are_validated_too():
    from pydantic import TypeAdapter

    e = TypeAdapter(EvalConfig).validate_python({"period": "week", "shots": [0, 3]})
    assert e.shots == (0, 3)
    with pytest.raises(ValidationError, match="period must be one of"):
        TypeAdapter(EvalConfig).validate_python({"period": "fortnight"})


def test_a_feeds_field_names_are_settings_of_one_name(tmp_path):
    """--date-field/--text-field/--id-field/--title-field/--missing-id, a deployment's `run` and Python's
    RunConfig name the same fields, and a run reads its feed with them (the others are missing to it)."""
    import typer.main

    from cli import app
    from cli.settings import config_from_options
    from monim.data.feed import StreamError
    from monim.data.stream import read_day

    feed = tmp_path / "feed.jsonl"
    feed.write_text('{"published": "1987-03-02", "body": "Rates rose.", "uid": 7, "headline": "Rates"}\n'
                    '{"published": "1987-03-02", "body": "Oil fell."}\n')
    args = ["--source", str(feed), "--date-field", "published", "--text-field", "body", "--id-field", "uid",
            "--title-field", "headline", "--missing-id", "hash"]
    params = typer.main.get_command(app).commands["learn"].make_context("learn", args).params
    cfg = config_from_options(params.pop("policy"), params.pop("source"), params.pop("workdir"), **params)
    deployed = RunConfig.model_validate({"source": str(feed), "date_field": "published", "text_field": "body",
                                         "id_field": "uid", "title_field": "headline", "missing_id": "hash"})
    assert cfg == deployed
    day = read_day(cfg.source, dt.date(1987, 3, 2), fields=cfg.fields())
    (first, second) = day.train
    assert (first.id, first.title, first.text) == ("7", "Rates", "Rates rose.")
    assert second.id.startswith("h") and second.title == "" and second.text == "Oil fell."
    with pytest.raises(StreamError, match="feed.jsonl:1: field 'date': missing"):
        read_day(cfg.source, dt.date(1987, 3, 2), fields=RunConfig(source=str(feed)).fields())
    with pytest.raises(ValidationError, match="four different fields"):
        RunConfig(text_field="date")


def test_which_setting_wins(tmp_path, monkeypatch):
    """docs/reference/configuration.md's claims: the option, else $MLFLOW_TRACKING_URI, else the work directory's
    SQLite file; Prefect's home in the work directory unless $PREFECT_HOME or $PREFECT_API_URL is set; a
    memory's recorded settings refuse a run that brings others (the option's default too), naming the field,
    while a reader's own may differ."""
    from cli.workdir import prefect_home
    from monim.core.config import DEFAULT_MODEL
    from monim.storage.memory_settings import READ, Settings, SettingsMismatch, refuse_other
    from tracking.store import tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri(str(tmp_path)) == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////elsewhere/env.db")
    assert tracking_uri(str(tmp_path)) == "sqlite:////elsewhere/env.db"
    assert tracking_uri(str(tmp_path), "sqlite:////elsewhere/option.db") == "sqlite:////elsewhere/option.db"

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("PREFECT_HOME", raising=False)
    prefect_home(tmp_path / "w1")
    assert os.environ["PREFECT_HOME"] == str((tmp_path / "w1" / "prefect").resolve())
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "mine"))
    prefect_home(tmp_path / "w2")
    assert os.environ["PREFECT_HOME"] == str(tmp_path / "mine")
    monkeypatch.delenv("PREFECT_HOME")
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    prefect_home(tmp_path / "w3")
    assert "PREFECT_HOME" not in os.environ and (tmp_path / "w3").is_dir()

    learned = {"model": DEFAULT_MODEL, "settings": Settings.of(RunConfig(delta=-2.0)).as_dict()}
    with pytest.raises(SettingsMismatch, match=r"field 'policy.delta': learned with -2.0, not -1.5"):
        refuse_other(learned, DEFAULT_MODEL, Settings.of(RunConfig()))  # `monim learn` without --delta -2.0
    refuse_other(learned, DEFAULT_MODEL, Settings.of(RunConfig(delta=-2.0)))
    refuse_other(learned, DEFAULT_MODEL, Settings.of(RunConfig(delta=-2.0, k=16)), READ)  # a reader's k
    with pytest.raises(SettingsMismatch, match="field 'model'"):
        refuse_other(learned, "gemma3-270m", Settings.of(RunConfig(delta=-2.0)))
