"""Θ is one thing: a memory records the settings it was learned with, and every reader (the day flow's
evaluation, `monim eval`, the champion gate, the served model, `generate`) reads it with them.
The cross-checks compare numbers each reader computes on its own path."""

import datetime as dt
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import refused
from monim.core.config import DEMO_STREAM, ScoreConfig
from monim.core.run_config import RunConfig
from monim.data.day import Day
from monim.data.feed import Document, open_feed
from monim.data.stream import iter_days
from monim.lm.scoring import with_neighbors
from monim.storage.index import IndexConfig
from monim.storage.memory_settings import Settings, SettingsMismatch
from monim.storage.workdirs import memory_root

DAYS = ("1987-03-02", "1987-03-03")
# everything a reader could get wrong differs from the defaults: the window, k, the skip rule
ODD = dict(stride=64, context=32, k=8, calibrator={"skip_threshold": 0.3})


def test_settings_round_trip_and_a_reader_may_change_only_how_it_reads():
    s = Settings(window=ScoreConfig(stride=64, context=32), index=IndexConfig(k=8))
    assert Settings.from_dict(json.loads(json.dumps(s.as_dict()))) == s
    read = s.read_with(k=16, skip_threshold=0.3, half_life=7.0, calibrated=False)
    assert (read.index.k, read.calibrator.skip_threshold, read.recency.half_life, read.calibrated) == (16, 0.3, 7.0, False)
    with pytest.raises(SettingsMismatch, match="window.stride: the memory was learned with 64, not 512"):
        s.read_with(stride=512)
    with pytest.raises(SettingsMismatch, match="index.exact_below"):
        s.read_with(exact_below=10)
    with pytest.raises(TypeError, match="unknown setting 'strid'"):
        s.read_with(strid=1)
    with pytest.raises(TypeError, match="ambiguous"):
        s.read_with(batch_size=1)  # the window's rows or the calibrator's


def test_a_writer_with_other_settings_is_refused_and_an_old_memory_adopts_them(tiny_model_dir, tmp_path):
    from monim.learning.memorize import memorize_day
    from monim.learning.policies import make_policy
    from monim.lm.model import load_lm
    from monim.theta.memory import Memory

    lm = load_lm(str(tiny_model_dir("llama")))
    day = next(iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 2), dt.date(1987, 3, 2))).capped(1)
    odd = Settings(window=ScoreConfig(stride=64, context=32), index=IndexConfig(k=8))
    memorize_day(Memory(tmp_path / "m", lm, odd), day, make_policy("fullmem"))
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert Settings.from_dict(manifest["settings"]) == odd  # recorded at the first commit
    with pytest.raises(SettingsMismatch, match="field 'window.stride': learned with 64, not 512"):
        Memory(tmp_path / "m", lm, Settings(index=IndexConfig(k=8)))
    opened = Memory.open(tmp_path / "m", lm, k=4)
    assert opened.settings.window == odd.window and opened.settings.index.k == 4
    # a memory written before monim recorded its settings takes the writer's, recorded by its next commit
    del manifest["settings"]
    (tmp_path / "m" / "manifest.json").write_text(json.dumps(manifest))
    old = Memory(tmp_path / "m", lm, odd)
    memorize_day(old, Day(dt.date(1987, 3, 3), day.train, [], []), make_policy("fullmem"))
    assert Settings.from_dict(json.loads((tmp_path / "m" / "manifest.json").read_text())["settings"]) == odd


@pytest.fixture(scope="module")
def odd_run(prefect, tiny_model_dir, tmp_path_factory):
    """Two days learned through the day flow with non-default window, k and skip rule, logged and registered."""
    from flows.stream import learn_stream

    workdir = tmp_path_factory.mktemp("odd")
    cfg = RunConfig(source=str(DEMO_STREAM), workdir=str(workdir), model=str(tiny_model_dir("llama")), max_docs=3,
                    policy="fullmem", **ODD)
    rows = learn_stream(cfg, DAYS[0], DAYS[1])
    return cfg, {r["date"]: r for r in rows}


@pytest.mark.slow
def test_eval_as_of_a_day_equals_the_days_recorded_test_ppl(monim, odd_run):
    cfg, rows = odd_run
    for date in DAYS:
        got = monim.json("eval", "--workdir", cfg.workdir, "--as-of", date, "--source", cfg.source, "--start", date,
                         "--end", date)
        assert got["tokens"] == rows[date]["tokens"] > 0
        assert got["ppl"] == pytest.approx(rows[date]["ppl"], rel=1e-9), date  # the same Θ, the same features
        assert got["ppl_lm"] == pytest.approx(rows[date]["ppl_lm"], rel=1e-9)


@pytest.mark.slow
def test_the_served_model_eval_and_the_gate_score_a_text_alike(monim, odd_run, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    from tasks.gate import validation_gate
    from tracking.versions import registered

    cfg, rows = odd_run
    day2 = next(iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 3), dt.date(1987, 3, 3)))
    text = day2.test[0].text[:1500]
    (tmp_path / "text.txt").write_text(text)
    uri = f"sqlite:///{Path(cfg.workdir).resolve() / 'mlflow.db'}"
    client, name = MlflowClient(uri), registered(uri, memory_root(cfg.workdir, cfg.name))
    version = next(v for v in client.search_model_versions(f"name = '{name}'") if v.tags["monim.as_of"] == DAYS[0])
    served = mlflow.pyfunc.load_model(client.get_model_version_download_uri(name, version.version))
    by_server = served.predict([{"text": text}])[0]
    by_eval = monim.json("eval", "--workdir", cfg.workdir, "--as-of", DAYS[0], "--text", tmp_path / "text.txt")
    champion = SimpleNamespace(tags={"monim.memory": str(memory_root(cfg.workdir, cfg.name).resolve()), "monim.as_of": DAYS[0]})
    from monim.run import open_run as run_for

    by_gate = validation_gate(cfg, Day(day2.date, [], [Document("t", day2.date, text)], []), run_for(cfg).memory, champion, uri)
    assert by_server["tokens"] == by_eval["text_tokens"] == by_gate["gate_tokens"]
    assert by_server["ppl"] == pytest.approx(by_eval["ppl_text"], rel=1e-5)
    assert by_server["ppl"] == pytest.approx(by_gate["gate_ppl_champion"], rel=1e-5)
    assert by_server["ppl"] != pytest.approx(by_server["ppl_lm"], rel=1e-3)  # the memory was read


@pytest.mark.slow
def test_generations_first_step_is_the_evaluations_distribution(odd_run):
    from monim.serving.generate import generate
    from monim.serving.generation import GenerateConfig
    from monim.theta.memory import Memory

    cfg, rows = odd_run
    memory = Memory.open(memory_root(cfg.workdir, cfg.name))
    assert memory.settings.window.stride == 64 and memory.settings.index.k == 8
    assert memory.settings.calibrator.skip_threshold == 0.3
    day = next(iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 2), dt.date(1987, 3, 2)))
    tokens = memory.lm.tokenizer(day.train[0].text)["input_ids"][:40]  # a learned article's start
    prompt = memory.lm.tokenizer.decode(tokens[:-1])
    gen = generate(memory.lm, prompt, memory, GenerateConfig(max_new_tokens=1, keep_distributions=True))
    # the evaluation's path: the document scored through the memory's window, searched, Θ's full distribution
    doc = Document("p", day.date, memory.lm.tokenizer.decode(tokens))
    memory.sync()
    batch = list(memory.features().scores([doc], "p"))[-1]
    last = with_neighbors(memory.lm, batch.select(slice(len(batch) - 1, len(batch))), memory.search)
    with torch.no_grad():
        lm_logp = torch.log_softmax(memory.lm.logits(torch.from_numpy(last.hidden)), -1).double()
    want, _, _ = memory.theta_logprobs(last, lm_logp)
    np.testing.assert_allclose(np.exp(gen.logprobs[0]), np.exp(want[0].numpy()), atol=2e-4)
    assert int(np.argmax(gen.logprobs[0])) == int(torch.argmax(want[0]))


@pytest.mark.slow
def test_a_forget_during_a_learns_commit_leaves_a_clean_run_plus_the_forget(monim, tiny_model_dir, tmp_path, prefect_api):
    """`monim forget` holds the memory's lock: started while `learn` writes a day, it waits for the
    commit and then removes the article; the memory equals a clean run's after that forget, and
    fsck finds it clean (no stray shard version, a champion that loads)."""
    import time

    from filelock import FileLock, Timeout

    from monim.storage.datastore import Datastore

    model, env = str(tiny_model_dir("gpt2")), os.environ | {"PREFECT_API_URL": prefect_api}  # the session's API: no start-up per learn
    args = ["learn", "--source", str(DEMO_STREAM), "--start", DAYS[0], "--end", "1987-03-04", "--policy", "fullmem",
            "--model", model, "--max-docs", "3"]
    victim = next(iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 2), dt.date(1987, 3, 2))).train[0].id
    racing, log = tmp_path / "racing", tmp_path / "learn.log"
    learn = subprocess.Popen([monim.script, *args, "--workdir", racing], env=env, stdout=subprocess.DEVNULL,
                             stderr=log.open("w"))
    root, deadline = racing / "memories" / "fullmem", time.monotonic() + 300
    while True:  # day 1 committed, and the learn holds the memory's lock (writing day 2)
        assert learn.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        if (root / "manifest.json").exists() and len(json.loads((root / "manifest.json").read_text())["days"]) == 1:
            try:
                FileLock(root / ".lock").acquire(timeout=0).lock.release()
            except Timeout:
                break
        time.sleep(0.05)
    for _ in range(2):  # repeated: the second removes nothing and writes nothing (no stray shard version)
        forget = subprocess.run([monim.script, "forget", "--workdir", racing, "--doc", victim, "--json"], env=env,
                                capture_output=True, text=True, timeout=600)
        assert forget.returncode == 0, forget.stderr[-3000:]
    assert learn.wait(timeout=600) == 0, log.read_text()[-3000:]
    clean = tmp_path / "clean"
    subprocess.run([monim.script, *args, "--workdir", clean], env=env, check=True, capture_output=True, timeout=600)
    subprocess.run([monim.script, "forget", "--workdir", clean, "--doc", victim], env=env, check=True, capture_output=True,
                   timeout=600)
    a, b = Datastore.read(racing / "memories" / "fullmem"), Datastore.read(clean / "memories" / "fullmem")
    assert [(d.date, d.entries, d.forgotten) for d in a.days] == [(d.date, d.entries, d.forgotten) for d in b.days]
    assert a.days[0].forgotten > 0 and len(a.days) == 3
    for name in ("values", "positions", "ids"):
        np.testing.assert_array_equal(a.shards.array(name), b.shards.array(name))
    np.testing.assert_array_equal(a.shards.array("keys"), b.shards.array("keys"))
    fsck = subprocess.run([monim.script, "fsck", "--workdir", racing, "--json"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert fsck.returncode == 0 and json.loads(fsck.stdout.strip().splitlines()[-1])["clean"], fsck.stdout


@pytest.mark.slow  # four `monim learn` processes
def test_delta_is_a_setting_the_memory_records_and_a_resume_with_another_is_refused(monim, tiny_model_dir, tmp_path):
    """`monim learn --delta -2.0` learns with δ = -2 (the manifest and `monim status` say so); a resume
    that brings another δ is refused before any work, naming delta; the same δ learns on."""
    learn = ["learn", "--source", DEMO_STREAM, "--workdir", tmp_path, "--model", tiny_model_dir("llama"),
             "--max-docs", 2, "--start", DAYS[0]]
    monim.json(*learn, "--end", DAYS[0], "--delta", -2.0)
    manifest = json.loads((tmp_path / "memories" / "monim-amt" / "manifest.json").read_text())
    assert manifest["settings"]["policy"]["delta"] == -2.0 and manifest["days"][0]["params"]["delta"] == -2.0
    refused(monim(*learn, "--end", DAYS[1], check=False, own_api=True), "'policy.delta': learned with -2.0, not -1.5")
    assert len(json.loads((tmp_path / "memories" / "monim-amt" / "manifest.json").read_text())["days"]) == 1
    monim.json(*learn, "--end", DAYS[1], "--delta", -2.0)
    status = monim.json("status", "--workdir", tmp_path)
    assert status["days"] == 2 and status["learned_with"] == {"delta": -2.0, "search_margin": 1.0, "search_context": False}
