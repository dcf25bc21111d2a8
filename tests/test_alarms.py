"""The operator's alarms on a real Prefect server (`prefect server start`, its trigger services on):
both automations of deployments/automations created from their files, the proactive one firing when
no daily run completes within its window; and each move of the champion (a new day, a rollback, a
promote, a forget's new version) received as a `monim.champion.moved` event."""

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from monim.core.config import DEMO_STREAM

REPO = Path(__file__).resolve().parents[1]
AUTOMATIONS = REPO / "deployments" / "automations"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A Prefect server of its own (the test session's harness runs no trigger services), and its API URL."""
    from servers import local

    home = tmp_path_factory.mktemp("prefect-home")
    port = local.free_port()
    env = os.environ | {"PREFECT_HOME": str(home)}
    proc = local.start([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1",
                          "--port", str(port)], f"http://127.0.0.1:{port}/api/health", timeout=180, env=env)
    yield f"http://127.0.0.1:{port}/api"
    local.stop([proc])


def api(url: str, path: str, body: dict | None = None) -> dict | list:
    req = urllib.request.Request(f"{url}{path}", json.dumps(body).encode() if body is not None else None,
                                 {"Content-Type": "application/json"}, method="POST" if body is not None else "GET")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


def automation(name: str, block_id: str, within: float | None = None, actions: list | None = None) -> dict:
    """An automation file of deployments/automations, its notification block named (a shorter window
    or other actions, for a test that must see it fire)."""
    spec = yaml.safe_load((AUTOMATIONS / name).read_text().replace("BLOCK-ID", block_id))
    if within is not None:
        spec["trigger"]["within"] = within
    return spec | ({"actions": actions} if actions is not None else {})


def test_both_alarms_are_created_and_the_missing_run_fires(server):
    from prefect.events.schemas.automations import AutomationCore

    block = "00000000-0000-0000-0000-000000000001"  # a notification block's id (never sent to here)
    failed = AutomationCore.model_validate(automation("daily-failed.yaml", block))
    missing = AutomationCore.model_validate(automation("daily-missing.yaml", block))
    assert failed.trigger.posture == "Reactive" and failed.trigger.expect == {"prefect.flow-run.Failed"}
    assert missing.trigger.posture == "Proactive" and missing.trigger.expect == {"prefect.flow-run.Completed"}
    assert missing.trigger.within.total_seconds() == 26 * 3600
    for spec in (failed, missing):
        assert spec.trigger.match_related.model_dump() == {"prefect.resource.role": "flow",
                                                           "prefect.resource.name": "monim-yesterday"}
        assert spec.actions[0].block_document_id.hex == block.replace("-", "")
    made = api(server, "/automations/", json.loads(failed.model_dump_json()))
    assert api(server, f"/automations/{made['id']}")["enabled"]
    # the proactive alarm with a short window, and an action whose effect shows that it fired: it
    # pauses the automation just made (a notification would leave this machine)
    pause = [{"type": "pause-automation", "source": "selected", "automation_id": made["id"]}]
    short = AutomationCore.model_validate(automation("daily-missing.yaml", block, within=10, actions=pause))
    api(server, "/automations/", json.loads(short.model_dump_json()))
    deadline = time.monotonic() + 120
    while api(server, f"/automations/{made['id']}")["enabled"]:
        assert time.monotonic() < deadline, "the proactive automation did not fire within 120 s"
        time.sleep(2)


def events(url: str, name: str) -> list[dict]:
    found = api(url, "/events/filter", {"filter": {"event": {"name": [name]}, "occurred": {"since": "2000-01-01T00:00:00Z"}},
                                        "limit": 50})
    return found["events"]


def test_each_move_of_the_champion_is_an_event(server, monim, tiny_model_dir, tmp_path):
    workdir = tmp_path / "w"
    run = type(monim)(server)  # the runner, with the deployment's server as its API, as a daily run has it

    run("learn", "--source", DEMO_STREAM, "--start", "1987-03-02", "--end", "1987-03-03", "--policy", "fullmem",
        "--workdir", workdir, "--model", tiny_model_dir("llama"), "--max-docs", "3")
    run("promote", "--workdir", workdir, "--version", "2")
    run("rollback", "--workdir", workdir)
    deadline = time.monotonic() + 60
    while True:
        moved = events(server, "monim.champion.moved")
        if {"promote", "rollback"} <= {e["payload"]["reason"] for e in moved}:
            break
        assert time.monotonic() < deadline, moved
        time.sleep(1)
    by_reason = {}
    for e in moved:
        by_reason.setdefault(e["payload"]["reason"], set()).add((e["payload"]["version"], e["payload"]["day"]))
    # the gate moved it to day one, and to day two where day two's validation PPL was not worse
    assert ("1", "1987-03-02") in by_reason["new day"] <= {("1", "1987-03-02"), ("2", "1987-03-03")}
    assert by_reason["promote"] == {("2", "1987-03-03")} and by_reason["rollback"] == {("1", "1987-03-02")}
    assert len({e["resource"]["prefect.resource.id"] for e in moved}) == 1
    assert moved[0]["resource"]["prefect.resource.id"] == f"monim.model.{moved[0]['payload']['model']}"
