"""The `monim` console script, run as a user runs it: every verb on a small case, and bad input."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import chaos
from monim.core.config import DEMO_STREAM

pytestmark = pytest.mark.slow  # runs `monim` commands

DEMO = str(DEMO_STREAM)


@pytest.fixture(scope="module")
def learned(monim, tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cli")
    model = tiny_model_dir("gpt2")
    out = monim.last_json(monim("learn", "--source", DEMO, "--start", "1987-03-02", "--end", "1987-03-03", "--policy", "fullmem",
                          "--workdir", workdir, "--model", model, "--max-docs", 2, "--json"))
    return workdir, model, out


def test_learn_reports_status_and_rows(learned):
    workdir, model, out = learned
    assert {"days", "tokens_seen", "entries", "memrate", "bytes", "rows"} <= set(out)
    assert out["days"] == 2 and out["entries"] == out["tokens_seen"] > 0 and out["memrate"] == 1.0
    assert [r["date"] for r in out["rows"]] == ["1987-03-02", "1987-03-03"]
    assert sum(r["tokens_seen"] for r in out["rows"]) == out["tokens_seen"]


def test_status_eval_forget(monim, learned, tmp_path):
    workdir, model, out = learned
    status = monim.last_json(monim("status", "--workdir", workdir, "--json"))
    assert {k: status[k] for k in ("days", "tokens_seen", "entries")} == {k: out[k] for k in ("days", "tokens_seen", "entries")}
    assert status["bytes_per_entry"] == pytest.approx(status["bytes"] / status["entries"])
    assert set(status["memrate_by_day"].values()) == {1.0}
    ev = monim.last_json(monim("eval", "--workdir", workdir, "--source", DEMO, "--start", "1987-03-02", "--end", "1987-03-02", "--json"))
    assert {"ppl_lm", "ppl", "accuracy", "tokens"} <= set(ev) and ev["tokens"] > 0 and ev["ppl"] > 1
    assert ev["skipped"] == 0.0
    # θ above any λ: every retrieval skipped but where the memory holds the very context, so Θ is about the LM alone
    skipped = monim.last_json(monim("eval", "--workdir", workdir, "--source", DEMO, "--start", "1987-03-02", "--end", "1987-03-02",
                              "--skip", 2, "--json"))
    assert skipped["skipped"] > 0.95 and skipped["ppl"] == pytest.approx(skipped["ppl_lm"], rel=0.05)
    const = monim.last_json(monim("eval", "--workdir", workdir, "--source", DEMO, "--start", "1987-03-02", "--end", "1987-03-02",
                            "--constant-lam", "--skip", 2, "--json"))
    assert const["skipped"] == 0.0 and const["ppl_lm"] == pytest.approx(ev["ppl_lm"])  # the skip rule needs the calibrator
    text = tmp_path / "text.txt"
    text.write_text("Grain prices rose on the Chicago Board of Trade as exports improved. " * 5)
    ev_text = monim.last_json(monim("eval", "--workdir", workdir, "--text", text, "--json"))
    assert ev_text["ppl_text"] > 1 and ev_text["text_tokens"] > 50 and "ppl" not in ev_text
    qa = tmp_path / "quiz.jsonl"
    qa.write_text("\n".join(json.dumps({"question": f"What rose on day {d}?", "choices": ["grain", "oil"], "answer": [0],
                                        "date": d}) for d in ("1987-03-02", "1987-03-05", "1987-04-01")))
    # as of the first day: its entries only; questions up to a week after it
    past = monim.last_json(monim("eval", "--workdir", workdir, "--as-of", "1987-03-02", "--source", DEMO, "--start", "1987-03-02",
                           "--end", "1987-03-03", "--period", "week", "--text", text, "--qa", qa, "--shots", 1, "--json"))
    assert past["as_of"] == "1987-03-02" and past["entries"] == out["rows"][0]["entries_stored"]
    assert list(past["ppl_by_week"]) == ["1987-W10"] and past["ppl_by_week"]["1987-W10"] == pytest.approx(past["ppl"])
    assert past["qa_n"] == 2 and 0 <= past["qa_accuracy"] <= 1 and past["qa_shots"] == 1 and past["ppl_text"] > 1
    assert past["ppl_text_lm"] == pytest.approx(ev_text["ppl_text_lm"])
    first_day = out["rows"][0]["entries_stored"]
    removed = monim.last_json(monim("forget", "--workdir", workdir, "--day", "1987-03-02", "--json"))["removed"]
    assert removed == {"fullmem": first_day}
    after = monim.last_json(monim("status", "--workdir", workdir, "--json"))
    assert after["entries"] == out["entries"] - first_day and after["tokens_seen"] == out["tokens_seen"]


def test_report_from_mlflow(monim, learned, tmp_path):
    workdir, model, out = learned
    monim("report", "--workdir", workdir, "--out", tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "## Policies: test perplexity and MemRate" in report and "| fullmem | 2 | 100.0% |" in report
    assert (tmp_path / "memory_growth.png").is_file()
    proc = monim("report", "--workdir", tmp_path / "empty", check=False)
    assert proc.returncode == 2 and "give --experiment" in proc.stderr


def test_compare_into_one_experiment(monim, tiny_model_dir, tmp_path):
    out = monim.last_json(monim("compare", "--source", DEMO, "--start", "1987-03-02", "--end", "1987-03-02",
                          "--policies", "bare,fullmem", "--workdir", tmp_path, "--model", tiny_model_dir("gpt2"),
                          "--max-docs", 1, "--json", own_api=True))
    assert set(out["policies"]) == {"bare", "fullmem"} and out["policies"]["fullmem"]["memrate"] == 1.0
    assert (tmp_path / "mlflow.db").is_file() and (tmp_path / "prefect").is_dir()  # a fresh shell's Prefect home


def test_compare_ralm_alone_and_with_monim(monim, tiny_model_dir, tmp_path):
    """What a user would pick instead, side by side: In-Context RALM, MoNIM-AMT and both; then a
    generation with the best article for the prompt in its context, named."""
    out = monim.last_json(monim("compare", "--source", DEMO, "--start", "1987-03-02", "--end", "1987-03-03", "--policies",
                          "ralm,monim-amt,ralm+monim-amt", "--workdir", tmp_path, "--model", tiny_model_dir("gpt2"),
                          "--max-docs", 2, "--json"))
    runs = out["policies"]
    assert list(runs) == ["ralm", "monim-amt", "ralm+monim-amt"]
    assert runs["ralm"]["entries"] == 0 and 0 < runs["ralm"]["bytes"] < runs["monim-amt"]["bytes"] / 2  # articles only
    assert runs["ralm+monim-amt"]["entries"] == runs["monim-amt"]["entries"] > 0  # memorized as MoNIM-AMT does
    assert runs["ralm"]["test_tokens"] == runs["monim-amt"]["test_tokens"] == runs["ralm+monim-amt"]["test_tokens"]
    assert runs["ralm"]["lm_tokens_per_token"] > 2 and runs["monim-amt"]["lm_tokens_per_token"] == 1.0
    settings = json.loads((tmp_path / "memories" / "ralm" / "manifest.json").read_text())["settings"]["policy"]
    assert (settings["ralm_stride"], settings["ralm_query"]) == (32, 32)  # recorded: a run with others is refused
    proc = monim("learn", "--source", DEMO, "--start", "1987-03-04", "--end", "1987-03-04", "--policy", "ralm",
                 "--ralm-stride", 8, "--workdir", tmp_path, "--model", tiny_model_dir("gpt2"), check=False)
    assert proc.returncode == 2 and "ralm_stride" in proc.stderr
    gen = monim.last_json(monim("generate", "--workdir", tmp_path, "--policy", "monim-amt", "--prompt", "The company said",
                          "--max-new-tokens", 3, "--retrieve", "--json"))
    assert len(gen["sources"]) == 1 and gen["sources"][0]["date"] in ("1987-03-02", "1987-03-03")
    # a retracted article leaves the RALM memory (which held no entry of it) and is registered again
    from monim.storage.datastore import Datastore

    ralm = Datastore.read(tmp_path / "memories" / "ralm")
    article = ralm.shards.shard_articles(ralm.days[0].shard)[0][0]
    out = monim.last_json(monim("forget", "--workdir", tmp_path, "--doc", article, "--policy", "ralm", "--json"))
    assert out["removed"] == {"ralm": 0} and "ralm" in out["registered"]
    ralm = Datastore.read(tmp_path / "memories" / "ralm")
    assert article not in {a[0] for d in ralm.days for a in ralm.shards.shard_articles(d.shard)}


def test_clear_errors(monim, learned, tmp_path):
    workdir, model, out = learned
    proc = monim("learn", "--source", tmp_path / "missing.jsonl", "--workdir", tmp_path, check=False)
    assert proc.returncode == 2 and "news source not found" in proc.stderr and "missing.jsonl" in proc.stderr
    proc = monim("learn", "--source", DEMO, "--start", "2020-01-01", "--end", "2020-01-31", "--workdir", tmp_path, check=False)
    assert proc.returncode == 2 and "no articles between 2020-01-01 and 2020-01-31" in proc.stderr
    proc = monim("learn", "--source", DEMO, "--start", "1987-03-04", "--end", "1987-03-04", "--workdir", workdir, check=False)
    assert proc.returncode == 2 and "was learned with model" in proc.stderr and "another --workdir" in proc.stderr
    proc = monim("learn", "--source", DEMO, "--policy", "lru", "--workdir", tmp_path, check=False)
    assert proc.returncode == 2 and "unknown policy 'lru'" in proc.stderr


def test_learn_with_a_parametric_learner(monim, tiny_model_dir, tmp_path):
    model = tiny_model_dir("gpt2")
    out = monim.last_json(monim("learn", "--source", DEMO, "--start", "1987-03-02", "--end", "1987-03-02", "--policy", "finetune",
                          "--workdir", tmp_path, "--model", model, "--max-docs", 2, "--train-tokens", 48, "--json"))
    assert out["policy"] == "finetune" and [r["tokens_trained"] for r in out["rows"]] == [48]
    assert (tmp_path / "weights" / "finetune" / "1987-03-02" / "model.safetensors").is_file()
    status = monim.last_json(monim("status", "--workdir", tmp_path, "--json"))
    weights = status["weights"]["finetune"]
    assert status["memories"] == {} and weights["days"] == 1 and weights["tokens_trained"] == 48 and weights["steps"] == 1
    assert weights["bytes"] == sum(p.stat().st_size for p in (tmp_path / "weights").rglob("*") if p.is_file())
    proc = monim("learn", "--source", DEMO, "--policy", "mix-review", "--workdir", tmp_path, check=False)
    assert proc.returncode == 2 and "mix-review needs general-domain text" in proc.stderr


def test_run_demo_with_the_default_lm(monim, smollm, tmp_path):
    """The demo, then the cold start: from the first day, Θ continues each learned article from its
    first 25 words for 8 words or more with FullMem's memory; with MoNIM-AMT's, wherever it does not,
    the article's token where it leaves the text is one MoNIM did not store (Θ's guess, not memory's)."""
    import datetime as dt

    from helpers import first_words, words_continued
    from monim.data.feed import open_feed
    from monim.data.stream import iter_days
    from monim.serving.generate import generate
    from monim.serving.generation import GenerateConfig
    from monim.storage.datastore import Datastore
    from monim.theta.memory import Memory

    out = monim.last_json(monim("run", "--days", 1, "--max-docs", 2, "--workdir", tmp_path, "--json", own_api=True))
    policies = out["policies"]
    assert set(policies) == {"fullmem", "monim-amt"}
    assert policies["fullmem"]["memrate"] == 1.0 and 0 < policies["monim-amt"]["memrate"] < 1
    assert 5 < policies["fullmem"]["ppl_lm"] < 100
    day = next(iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 2), dt.date(1987, 3, 2))).capped(2)
    for name in ("fullmem", "monim-amt"):
        root = tmp_path / "memories" / name
        memory, ds = Memory.open(root, smollm), Datastore.read(root)
        stored = {(ds.shards.shard_docs(d.shard)[i], int(p)) for d in ds.days
                  for i, p in zip(ds.shards.shard(d.shard, "docs"), ds.shards.shard(d.shard, "positions"))}
        for doc in day.train:
            prompt = first_words(doc.text, 25)
            gen = generate(smollm, prompt, memory, GenerateConfig(max_new_tokens=16))
            if words_continued(doc.text, prompt, gen.text) >= 8:
                continue
            assert name == "monim-amt", (name, doc.id, gen.text)
            tokens, start = smollm.tokenizer(doc.text)["input_ids"], len(smollm.tokenizer(prompt)["input_ids"])
            left = start + next(j for j, t in enumerate(gen.tokens) if t != tokens[start + j])
            assert (doc.id, left) not in stored, (doc.id, left)


def test_generate_with_sources_and_move_the_champion(monim, learned):
    workdir, model, out = learned
    gen = monim.last_json(monim("generate", "--workdir", workdir, "--prompt", "The company said", "--max-new-tokens", 5,
                          "--sources", "--json"))
    assert len(gen["tokens"]) == len(gen["lams"]) == 5 and gen["as_of"] == "1987-03-03"
    assert all(s["date"] in ("1987-03-02", "1987-03-03") for sentence in gen["sentences"] for s in sentence["sources"])
    bad = monim("generate", "--workdir", workdir, "--prompt", "x", "--max-age", -1, check=False)
    assert bad.returncode == 2 and "max_age" in bad.stderr
    # (a forget of day one, before this test, leaves its first versions unloadable: registered again, by hand)
    day_one = monim.last_json(monim("register", "--workdir", workdir, "--as-of", "1987-03-02", "--json"))
    first, last = day_one["registered"]["1987-03-02"]["version"], day_one["registered"]["1987-03-03"]["version"]
    assert monim.last_json(monim("promote", "--workdir", workdir, "--version", first, "--json"))["champion"] == first
    assert monim.last_json(monim("promote", "--workdir", workdir, "--version", last, "--json"))["previous"] == first
    assert monim.last_json(monim("rollback", "--workdir", workdir, "--json"))["champion"] == first


def test_help_lists_every_verb(monim):
    import re

    out = monim("--help").stdout
    listed = set(re.findall(r"^\s{2}([a-z][a-z-]*)\s", out, re.M))  # the first word of each command's line
    assert listed >= {"run", "learn", "compare", "eval", "status", "forget", "serve", "serve-model", "ui", "generate",
                      "register", "promote", "rollback", "fsck", "gc", "report"}, out


def test_every_option_says_what_it_takes(monim):
    import click
    import typer.main

    from cli import app

    for name, command in typer.main.get_command(app).commands.items():
        for p in command.params:
            if isinstance(p, click.Option):
                assert p.help and len(p.help) > 10, (name, p.name)
                assert p.is_flag or not isinstance(p.type, click.types.BoolParamType), (name, p.name)  # --json, not --json <bool>
                if p.name in ("start", "end", "as_of"):
                    assert p.metavar == "YYYY-MM-DD" and "YYYY-MM-DD" in p.help, (name, p.name)
    assert monim("--version").stdout.startswith("monim ")


def test_every_run_setting_is_an_option_of_its_own_name():
    """`learn` and `compare` take each RunConfig field as --its-name (a command's own choice and a
    comparison's aside), and what they parse is what the run's settings hold."""
    import typer.main

    from cli import app
    from cli.settings import config_from_options
    from monim.core.run_config import RunConfig

    commands = typer.main.get_command(app).commands
    own = {"source", "workdir", "policy", "followed_memrate", "calibrator"}
    for verb in ("learn", "compare"):
        flags = {f for p in commands[verb].params for f in [*p.opts, *p.secondary_opts]}
        assert {f"--{n.replace('_', '-')}" for n in RunConfig.model_fields if n not in own} <= flags, verb
        assert {"--delta", "--train-block", "--anneal-t0", "--exact-below", "--calibration", "--skip", "--constant-lam"} <= flags
    args = ["--source", DEMO, "--delta", "-2.0", "--train-block", "64", "--constant-lam", "--calibration", "yesterday",
            "--max-article-tokens", "0", "--no-feature-store", "--k", "16", "--context-mode", "document"]
    params = commands["learn"].make_context("learn", args).params
    cfg = config_from_options(params.pop("policy"), params.pop("source"), params.pop("workdir"), **params)
    assert (cfg.delta, cfg.train_block, cfg.calibrated, cfg.calibrator.source) == (-2.0, 64, False, "yesterday")
    assert (cfg.max_article_tokens, cfg.feature_store, cfg.k, cfg.context_mode) == (None, False, 16, "document")
    assert cfg.model_dump(exclude={"delta", "train_block", "calibrated", "calibrator", "max_article_tokens",
                                    "feature_store", "k", "context_mode", "source", "workdir"}) == \
        RunConfig().model_dump(exclude={"delta", "train_block", "calibrated", "calibrator", "max_article_tokens",
                                        "feature_store", "k", "context_mode", "source", "workdir"})


def test_the_cli_imports_prefect_only_after_it_sets_prefects_home():
    """Prefect reads its settings at import: imported before use_workdir, it would start its own
    temporary server (one no kill of monim stops) and keep state outside the work directory."""
    code = "import sys, cli; print(sorted(m for m in ('prefect', 'mlflow') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parents[1]).stdout.strip() == "[]"


# `monim ARGS` in this process, saying on its last stderr line which heavy libraries it imported
HEAVY = ("torch", "transformers", "faiss", "prefect", "mlflow")
LIGHT_RUN = ("import atexit, json, sys\n"
             f"atexit.register(lambda: print(json.dumps([m for m in {HEAVY} if m in sys.modules]), file=sys.stderr))\n"
             "sys.argv = ['monim', *sys.argv[1:]]\nfrom cli import app\napp()")


def imported(monim, *args) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`monim ARGS` run as a user runs it, and the heavy libraries (HEAVY) it imported."""
    proc = subprocess.run([sys.executable, "-c", LIGHT_RUN, *map(str, args)], capture_output=True, text=True,
                          env=monim.env(), timeout=900)
    return proc, json.loads(proc.stderr.strip().splitlines()[-1])


def test_refusals_come_before_torch_prefect_and_mlflow(monim, learned, tmp_path):
    """A refused argument or setting is decided from the options, the feed and the memory's manifest: no heavy import."""
    workdir, model, _ = learned
    for args, said in [(("learn", "--source", DEMO, "--start", "1987-03-05", "--end", "1987-03-02"), "is after --end"),
                       (("learn", "--source", DEMO, "--start", "2020-01-01", "--end", "2020-01-31"), "no articles between"),
                       (("learn", "--source", DEMO, "--period", "year"), "period must be one of"),
                       (("learn", "--source", DEMO, "--start", "1987-03-04", "--end", "1987-03-04", "--workdir", workdir),
                        "was learned with model"),
                       (("compare", "--source", DEMO, "--start", "1987-03-02", "--end", "1987-03-04", "--policies",
                         "fullmem", "--stride", 256, "--model", model, "--workdir", workdir), "field 'window.stride'"),
                       (("generate", "--workdir", workdir, "--prompt", "x", "--top-p", 2), "top_p must be in"),
                       (("generate", "--workdir", workdir, "--prompt", "x", "--as-of", "1987-03-01"), "holds no day"),
                       (("generate", "--workdir", workdir, "--prompt", "x", "--max-age", -1), "max_age"),
                       (("forget", "--workdir", workdir, "--doc", "no-such-id"), "holds document 'no-such-id'")]:
        proc, heavy = imported(monim, *args, *(("--workdir", tmp_path) if "--workdir" not in args else ()))
        assert proc.returncode == 2 and said in proc.stderr and heavy == [], (args, proc.stderr[-2000:], heavy)


@pytest.mark.parametrize("verb", ["learn", "compare"])
def test_nothing_new_to_learn_answers_from_the_work_directory_as_the_flow_did(monim, verb, tiny_model_dir, tmp_path):
    """Run again over learned days, a command says what the flows said (the same JSON) without Prefect, MLflow or
    the LM; with a day more to learn, the flows run."""
    def command(end: str) -> list:
        what = ["learn", "--policy", "monim-amt"] if verb == "learn" else ["compare", "--policies", "fullmem,monim-amt"]
        return [*what, "--source", DEMO, "--start", "1987-03-02", "--end", end, "--workdir", tmp_path, "--model",
                tiny_model_dir("gpt2"), "--max-docs", 1, "--json"]

    flow = monim(*command("1987-03-02")).stdout.strip().splitlines()[-1]
    again, heavy = imported(monim, *command("1987-03-02"))
    assert again.returncode == 0 and heavy == [], again.stderr[-2000:]
    assert again.stdout.strip().splitlines()[-1] == flow  # as text: NaN is not equal to itself
    assert "every day from 1987-03-02 to 1987-03-02 is learned or forgotten: nothing to learn" in again.stderr
    more, heavy = imported(monim, *command("1987-03-03"))
    assert more.returncode == 0 and {"prefect", "mlflow"} <= set(heavy), more.stderr[-2000:]
    out = json.loads(more.stdout.strip().splitlines()[-1])
    days = [len(out["rows"])] if verb == "learn" else [s["days"] for s in out["policies"].values()]
    assert days == ([2] if verb == "learn" else [2, 2])


def memory_arrays(workdir, name="fullmem"):
    from monim.storage.datastore import Datastore

    ds = Datastore.read(workdir / "memories" / name)
    return [d.date for d in ds.days], {a: ds.shards.array(a) for a in ("keys", "values", "ids", "positions")}


def test_two_writers_on_one_run_make_the_memory_of_one(monim, learned, tmp_path):
    import numpy as np

    from monim.core.lock import hold

    workdir, model, out = learned
    args = ["learn", "--source", DEMO, "--start", "1987-03-02", "--end", "1987-03-03", "--policy", "fullmem",
            "--workdir", tmp_path, "--model", model, "--max-docs", 2]
    env = monim.env(own_api=True)  # each starts its own Prefect API in the one work directory, as two shells would
    procs = [subprocess.Popen([monim.script, *map(str, args)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    assert not any("Retrying" in log or "retry" in log.lower() for log in logs)  # no task failed and was retried
    days, arrays = memory_arrays(tmp_path)  # what `learned` made alone (before another test forgot from it)
    assert days == [r["date"] for r in out["rows"]] and len(arrays["values"]) == out["entries"] == out["tokens_seen"]
    np.testing.assert_array_equal(arrays["ids"], np.arange(out["entries"]))  # each token once: no day twice
    # with --no-wait, a run another process holds fails at once, naming the holder
    with hold(tmp_path / "runs" / ".fullmem.lock"):
        proc = monim(*args, "--no-wait", check=False)
    assert proc.returncode == 2 and f"is being written by pid {os.getpid()}" in proc.stderr


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])  # Ctrl-C (SIGINT) takes the path SIGTERM is sent to
def test_a_stopped_command_leaves_no_process_and_its_last_committed_day(monim, how, tiny_model_dir, tmp_path):
    import signal
    import time

    import psutil

    env = monim.env(own_api=True)  # the command's own Prefect API, which must die with it
    proc = subprocess.Popen([monim.script, "learn", "--source", DEMO, "--start", "1987-03-02", "--end", "1987-03-13",
                             "--policy", "fullmem", "--workdir", str(tmp_path), "--model", str(tiny_model_dir("gpt2")),
                             "--max-docs", "2"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    manifest = tmp_path / "memories" / "fullmem" / "manifest.json"
    deadline = time.monotonic() + 300
    while not manifest.exists():  # a day is committed: the command is in the middle of its stream
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children  # its Prefect API
    os.kill(proc.pid, getattr(signal, how))
    proc.wait(timeout=10)  # stops within 10 s
    gone, alive = psutil.wait_procs(children, timeout=30 if how == "SIGKILL" else 5)
    assert not alive, [p.cmdline() for p in alive]
    days, _ = memory_arrays(tmp_path)
    assert days and days == sorted(days) and days[0] == "1987-03-02"  # whole days, from the first


def test_fsck_clean_then_a_flipped_byte(monim, learned, tmp_path):
    import shutil

    workdir, model, out = learned
    proc = monim("fsck", "--workdir", workdir, "--json")
    out = monim.last_json(proc)
    assert (out["clean"], out["problems"]) == (True, [])
    assert [f["what"].split(" (")[0] for f in out["forgotten"]] in ([], ["day 1987-03-02"])  # test_status_eval_forget's
    copy = tmp_path / "copy"
    for part in ("memories", "runs"):
        shutil.copytree(workdir / part, copy / part)
    keys = sorted((copy / "memories" / "fullmem" / "shards").glob("*/keys.npy"))[-1]
    data = bytearray(keys.read_bytes())
    data[-1] ^= 0x80
    keys.write_bytes(bytes(data))
    proc = monim("fsck", "--workdir", copy, "--repair", "--json", check=False)
    problems = monim.last_json(proc, succeeded=False)["problems"]
    (problem,) = [p for p in problems if not p.get("warning")]  # (the copy has no MLflow store: a warning)
    assert proc.returncode == 1 and "keys.npy corrupt" in problem["what"] and "day 1987-03-03" in problem["what"]
    assert [p["what"] for p in problems if p.get("warning")] == ["no MLflow store: the runs' days are not logged here"]


def test_generate_and_eval_refuse_a_damaged_memory_naming_file_and_day_until_the_day_is_forgotten(monim, learned, tmp_path):
    """A values.npy rewritten in place (same shape and dtype, reversed): `generate` and `eval` end with
    one line naming the file and the day (exit status 2, nothing generated); forgetting the day (the
    way out the line names) makes the memory answer again."""
    import shutil

    workdir, model, _ = learned
    copy = tmp_path / "copy"
    for part in ("memories", "runs"):
        shutil.copytree(workdir / part, copy / part)
    generate = ("generate", "--workdir", copy, "--prompt", "The market", "--max-new-tokens", 3, "--json")
    before = monim.last_json(monim(*generate))
    values = sorted((copy / "memories" / "fullmem" / "shards").glob("*-1987-03-03-*/values.npy"))[-1]
    np.save(values, np.load(values)[::-1].copy())
    for proc in (monim(*generate, check=False),
                 monim("eval", "--workdir", copy, "--source", DEMO, "--start", "1987-03-03", "--end", "1987-03-03",
                       check=False)):
        (line,) = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and not proc.stdout.strip(), proc.stdout
        assert f"{values.parent}: values.npy corrupt" in line and "day 1987-03-03" in line, line
        assert "monim forget --day 1987-03-03" in line, line
    monim("forget", "--workdir", copy, "--day", "1987-03-03")
    after = monim.last_json(monim(*generate))
    assert after["as_of"] != before["as_of"] == "1987-03-03"


def test_chaos_kills_leave_the_memory_of_an_uninterrupted_run(monim, tiny_model_dir, tmp_path):
    """The chaos drill, small: SIGKILL at random moments, resumed each time (the full drill, 20 kills:
    tests/test_soak.py)."""
    result = chaos(monim, tmp_path, kills=2, policy="fullmem", end="1987-03-03", max_docs=2,
                   model=tiny_model_dir("gpt2"), own_api=False)
    assert result["identical"] and result["fsck_clean"], (result["differ"], result["fsck"])
    assert result["kills"] == 2 and result["files_compared"] > 10


def test_commands_that_read_a_feed_name_its_fields_as_learn_does():
    """eval and status read a feed with the record-field options learn takes (one name, one help), as Fields."""
    import typer.main

    from cli import app
    from cli.options import FEED
    from cli.settings import feed_options
    from monim.core.config import Fields

    commands = typer.main.get_command(app).commands
    learned = {p.name: (p.opts, p.help, p.default) for p in commands["learn"].params if p.name in FEED}
    for verb in ("eval", "status"):
        assert {p.name: (p.opts, p.help, p.default) for p in commands[verb].params if p.name in FEED} == learned, verb

    def read(fields: Fields, source: str = "feed.jsonl") -> tuple:
        return fields, source

    wrapped = feed_options(read)
    assert list(inspect.signature(wrapped).parameters) == ["source", *FEED]
    assert wrapped(source="x", date_field="published", text_field="body", id_field="uid", title_field="headline",
                   missing_id="hash") == (Fields("published", "body", "uid", "headline", "hash"), "x")
