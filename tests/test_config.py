"""The typed run spec: what a deployment or the Prefect UI's form may pass, and what it may not."""

import pytest
from pydantic import ValidationError

from monim.core.config import RunConfig
from monim.storage.workdirs import memory_root
from tasks.tracking.runs import run_params
from monim.evaluation.suite import EvalConfig


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
