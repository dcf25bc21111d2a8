"""The served model stays up to date: `monim serve-model` follows the champion while clients ask (a
new day learned and promoted, then a forget), with no failed request, and once it has followed it
answers as the new version answers alone (`monim generate` as of that day) and never cites a
forgotten article."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from monim.core.config import DEMO_STREAM
from servers.client import Clients, health  # the load benchmark's clients: what it measures is tested here

FOLLOW_S = 1.0  # --follow-seconds: how often the server looks at the alias
BOUND_S = 60  # the README's bound on the time to follow (a check, a load, the request in flight)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def following(monim, prefect_api, tiny_model_dir, tmp_path_factory):
    """Day one learned (MLflow on), and `monim serve-model` following its champion."""
    from servers import local

    workdir = tmp_path_factory.mktemp("follow") / "w"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_API_URL": prefect_api}
    learn = [monim.script, "learn", "--source", str(DEMO_STREAM), "--start", "1987-03-02", "--policy", "fullmem",
             "--workdir", str(workdir), "--model", str(tiny_model_dir("llama")), "--max-docs", "3"]
    subprocess.run(learn + ["--end", "1987-03-02"], env=env, check=True, capture_output=True, timeout=900)
    port = local.free_port()
    proc = local.start([monim.script, "serve-model", "--workdir", str(workdir), "--port", str(port), "--follow-seconds",
                          str(FOLLOW_S)], f"http://127.0.0.1:{port}/ping", env=env)
    yield port, workdir, env, learn
    local.stop([proc])


def clients(port: int, prompt: str) -> Clients:
    """Two clients asking again and again, a prompt (sources on) and a text each time."""
    body = {"dataframe_records": [{"prompt": prompt}, {"text": prompt + " and more."}],
            "params": {"max_new_tokens": 3, "sources": 10}}
    return Clients(port, [body], 2)


def wait_for(port: int, check, what: str) -> tuple[dict, float]:
    """/health once `check` holds for it, and the seconds waited (at most BOUND_S)."""
    started = time.monotonic()
    while not check(h := health(port)):
        assert time.monotonic() - started < BOUND_S, f"not {what} after {BOUND_S} s: {h}"
        time.sleep(0.2)
    return h, time.monotonic() - started


def cited(answer: dict) -> set[str]:
    return {s["doc_id"] for sentence in answer["sentences"] for s in sentence["sources"]}


def alone(monim, workdir: Path, env: dict, prompt: str, as_of: str) -> list[int]:
    """The continuation `monim generate` gives as of a day, in a process of its own."""
    out = subprocess.run([monim.script, "generate", "--workdir", str(workdir), "--prompt", prompt, "--as-of", as_of,
                          "--max-new-tokens", "3", "--json"], env=env, check=True, capture_output=True, text=True,
                         timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens"]


def test_the_server_follows_a_new_champion_while_clients_ask(monim, following, invoke):
    port, workdir, env, learn = following
    first = health(port)
    assert (first["status"], first["version"], first["as_of"], first["follows"]) == ("ok", "1", "1987-03-02", "champion")
    prompt = "The company said"
    load = clients(port, prompt)
    try:
        subprocess.run(learn + ["--end", "1987-03-03"], env=env, check=True, capture_output=True, timeout=900)
        subprocess.run([monim.script, "promote", "--workdir", str(workdir), "--version", "2"], env=env, check=True,
                       capture_output=True, timeout=300)
        moved = time.monotonic()
        now, waited = wait_for(port, lambda h: h["version"] == "2", "serving version 2")
        time.sleep(1)
    finally:
        load.stop()
    assert {status for _, status, _ in load.asked} == {200}, load.asked[-3:]
    assert now["as_of"] == "1987-03-03" and now["status"] == "ok" and now["served_since"] > first["served_since"]
    assert waited <= BOUND_S and now["checked_at"] is not None
    later = load.answered(moved + waited)
    assert later and later[-1]["predictions"][0]["tokens"] == alone(monim, workdir, env, prompt, "1987-03-03")


def test_a_forget_reaches_the_server_while_clients_ask(monim, following, invoke):
    port, workdir, env, learn = following
    memory = json.loads((workdir / "memories" / "fullmem" / "manifest.json").read_text())
    first_doc = json.loads((workdir / "memories" / "fullmem" / "shards" / memory["days"][0]["shard"] / "docs.json").read_text())[0]
    text = next(json.loads(line)["text"] for line in __import__("gzip").open(DEMO_STREAM, "rt")
                if json.loads(line)["id"] == first_doc)
    prompt = " ".join(text.split()[:12])  # the start of a memorized article: its entries carry the weight
    status, out = invoke(port, {"dataframe_records": [{"prompt": prompt}], "params": {"max_new_tokens": 8, "sources": 10}})
    assert status == 200 and first_doc in cited(out["predictions"][0]), out
    before = health(port)
    load = clients(port, prompt)
    try:
        forget = subprocess.run([monim.script, "forget", "--workdir", str(workdir), "--doc", first_doc, "--json"], env=env,
                                capture_output=True, text=True, timeout=300)
        assert forget.returncode == 0, forget.stderr[-3000:]
        done = time.monotonic()
        registered = json.loads(forget.stdout.strip().splitlines()[-1])["registered"]["fullmem"]
        assert registered["replaced"] == before["version"] and registered["champion"] != before["version"]
        now, waited = wait_for(port, lambda h: h["version"] == registered["champion"], "serving the forget")
        time.sleep(1)
    finally:
        load.stop()
    assert {status for _, status, _ in load.asked} == {200}, load.asked[-3:]
    assert now["as_of"] == before["as_of"] and now["checksum"] != before["checksum"] and now["status"] == "ok"
    assert load.answered(done + waited) and load.cited(done + waited)[first_doc] == 0
    status, out = invoke(port, {"dataframe_records": [{"prompt": prompt}], "params": {"max_new_tokens": 8, "sources": 10}})
    assert status == 200 and first_doc not in cited(out["predictions"][0])
    fsck = subprocess.run([monim.script, "fsck", "--workdir", str(workdir), "--json"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert fsck.returncode == 0, fsck.stdout[-3000:]


def test_a_champion_that_cannot_load_leaves_the_last_good_one_serving(monim, following, invoke):
    """Version 1 (day one before the forget) made champion in the registry (as MLflow's UI can; `monim
    promote` refuses it): the server cannot load it (its memory changed since) and keeps answering
    with the version it serves, /health "stale" naming why; `monim fsck` names the champion,
    `--repair` registers day one's state and the server follows it."""
    from mlflow.tracking import MlflowClient

    port, workdir, env, learn = following
    served = health(port)
    refused = subprocess.run([monim.script, "promote", "--workdir", str(workdir), "--version", "1"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "can no longer load" in refused.stderr and "monim register" in refused.stderr
    MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}").set_registered_model_alias(served["model"], "champion", "1")
    stale, _ = wait_for(port, lambda h: h["status"] == "stale", "stale")
    assert stale["version"] == served["version"] and "version 1 could not be loaded" in stale["problem"]
    assert "has changed since" in stale["problem"] and stale["champion"]["version"] == "1"
    status, out = invoke(port, {"dataframe_records": [{"prompt": "The bank"}], "params": {"max_new_tokens": 2}})
    assert status == 200
    fsck = subprocess.run([monim.script, "fsck", "--workdir", str(workdir), "--json"], env=env, capture_output=True,
                          text=True, timeout=300)
    problems = json.loads(fsck.stdout.strip().splitlines()[-1])["problems"]
    assert fsck.returncode == 1 and [p["where"] for p in problems if "can no longer load" in p["what"]] == [
        f"{served['model']}@champion"], problems
    subprocess.run([monim.script, "fsck", "--workdir", str(workdir), "--repair"], env=env, check=True, capture_output=True,
                   timeout=300)
    repaired, _ = wait_for(port, lambda h: h["status"] == "ok" and h["version"] != served["version"], "ok again")
    assert repaired["as_of"] == "1987-03-02" and repaired["version"] not in ("1", served["version"])
    assert subprocess.run([monim.script, "fsck", "--workdir", str(workdir)], env=env, capture_output=True).returncode == 0


def test_forgetting_the_champions_whole_day_moves_the_champion_to_the_day_before(monim, following, invoke):
    """The champion of the last day, that day forgotten whole (a takedown of a day): the champion
    moves to the day before's state, `previous` stays a version that loads, and the server follows;
    no answer after cites an article of the forgotten day."""
    port, workdir, env, learn = following
    newest = json.loads(subprocess.run([monim.script, "register", "--workdir", str(workdir), "--json"], env=env, check=True,
                                       capture_output=True, text=True).stdout.strip().splitlines()[-1])
    last_day = newest["registered"]["1987-03-03"]["version"]
    subprocess.run([monim.script, "promote", "--workdir", str(workdir), "--version", last_day], env=env, check=True,
                   capture_output=True, timeout=300)
    wait_for(port, lambda h: h["version"] == last_day, "serving the last day")
    memory = json.loads((workdir / "memories" / "fullmem" / "manifest.json").read_text())
    gone = set(json.loads((workdir / "memories" / "fullmem" / "shards" / memory["days"][-1]["shard"] / "docs.json").read_text()))
    load = clients(port, "The company said")
    try:
        forget = subprocess.run([monim.script, "forget", "--workdir", str(workdir), "--day", "1987-03-03", "--json"], env=env,
                                capture_output=True, text=True, timeout=300)
        assert forget.returncode == 0, forget.stderr[-3000:]
        done = time.monotonic()
        moved = json.loads(forget.stdout.strip().splitlines()[-1])["registered"]["fullmem"]
        assert moved["replaced"] == last_day and set(moved["registered"]) == {"1987-03-02"}
        now, waited = wait_for(port, lambda h: h["version"] == moved["champion"], "serving the day before")
        time.sleep(1)
    finally:
        load.stop()
    assert {status for _, status, _ in load.asked} == {200} and now["as_of"] == "1987-03-02"
    assert load.answered(done + waited) and not gone & set(load.cited(done + waited))
    rollback = subprocess.run([monim.script, "rollback", "--workdir", str(workdir), "--json"], env=env, capture_output=True,
                              text=True, timeout=300)
    assert rollback.returncode == 0, rollback.stderr[-2000:]  # `previous` is a version that loads, not the replaced one


def test_a_served_file_changed_under_the_server_is_never_answered_from_and_a_damaged_champion_does_not_start(
        monim, following, invoke):
    """A served values.npy rewritten in place (same shape and dtype, reversed): /health says damaged
    and every request is refused (503), naming the file and the day, /ping answers 503; a server
    started on it does not start (one line naming them, non-zero exit); put back, it answers again."""
    import urllib.error
    import urllib.request

    import numpy as np

    from servers import local

    port, workdir, env, learn = following
    wait_for(port, lambda h: h["status"] == "ok" and h["version"] == (h["champion"] or {}).get("version", "1"), "settled")
    memory = json.loads((workdir / "memories" / "fullmem" / "manifest.json").read_text())
    values = workdir / "memories" / "fullmem" / "shards" / memory["days"][0]["shard"] / "values.npy"
    good = values.read_bytes()
    body = {"dataframe_records": [{"prompt": "The bank"}], "params": {"max_new_tokens": 2}}
    try:
        np.save(values, np.load(values)[::-1].copy())
        damaged, _ = wait_for(port, lambda h: h["status"] == "damaged", "damaged")
        assert f"{values}: written since it was verified" in damaged["problem"] and "day 1987-03-02" in damaged["problem"]
        status, out = invoke(port, body)
        assert status == 503 and str(values) in out["message"] and "monim forget --day 1987-03-02" in out["message"]
        with pytest.raises(urllib.error.HTTPError) as ping:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ping")
        assert ping.value.code == 503
        start = monim("serve-model", "--workdir", workdir, "--port", local.free_port(), check=False, timeout=300)
        (line,) = start.stderr.strip().splitlines()
        assert start.returncode != 0 and f"{values.parent}: values.npy corrupt" in line and "day 1987-03-02" in line
    finally:
        values.write_bytes(good)  # in place again: the commit's bytes
    wait_for(port, lambda h: h["status"] == "ok", "ok again")
    assert invoke(port, body)[0] == 200
