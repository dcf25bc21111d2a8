"""The stream's bookkeeping as strict as its commits (issue 57), through `monim` as a user runs it on a
small feed and a tiny model: a forget is forever, an id names one article across the stream, every
record is counted, late articles are named wherever a run reads their day, a range that cannot be
learned is refused before any work, and meaningless settings are refused naming the field."""

import datetime as dt
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import demo_rows, learn, refused, write_feed
from monim.storage.datastore import Datastore


def memory(workdir: Path) -> Datastore:
    return Datastore.read(workdir / "memories" / "fullmem")


@pytest.fixture(scope="module")
def model(tiny_model_dir, monim) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def learned(monim, model, tmp_path_factory) -> tuple[Path, Path]:
    """Two days learned (1987-03-02 and 03-03, three articles each) from a feed that holds a third."""
    root = tmp_path_factory.mktemp("learned")
    source = write_feed(root / "feed.jsonl", demo_rows(3, 3))
    assert learn(monim, source, root / "w", model, "--end", "1987-03-03").returncode == 0
    return source, root / "w"


def copy(monim, learned, tmp_path: Path) -> tuple[Path, Path]:
    """The learned work directory copied (its MLflow run pointed at the copy, as fsck repairs a moved one)."""
    source, workdir = learned
    shutil.copytree(workdir, tmp_path / "w")
    assert monim("fsck", "--workdir", tmp_path / "w", "--repair", check=False).returncode == 0
    return Path(shutil.copy(source, tmp_path / "feed.jsonl")), tmp_path / "w"


@pytest.mark.slow
def test_a_forgotten_last_day_is_never_learned_again_unless_named(monim, learned, model, tmp_path):
    source, workdir = copy(monim, learned, tmp_path)
    out = monim.last_json(monim("forget", "--workdir", workdir, "--day", "1987-03-03", "--reason", "takedown", "--json", check=False))
    assert out["removed"]["fullmem"] > 0 and [d.date for d in memory(workdir).days] == ["1987-03-02"]
    again = learn(monim, source, workdir, model, "--end", "1987-03-03")  # a re-run of the range: nothing comes back
    assert again.returncode == 0 and "1 forgotten, 0 to learn" in again.stderr, again.stderr[-3000:]
    assert [d.date for d in memory(workdir).days] == ["1987-03-02"]
    status = monim.last_json(monim("status", "--workdir", workdir, "--json", check=False))
    (event,) = status["memories"]["fullmem"]["forgotten"]
    assert event["reason"] == "takedown" and event["what"].startswith("day 1987-03-03 (3 articles)")
    fsck = monim("fsck", "--workdir", workdir, "--json", check=False)
    assert fsck.returncode == 0 and monim.last_json(fsck)["forgotten"][0]["reason"] == "takedown"
    assert learn(monim, source, workdir, model).returncode == 0  # resumes after it: the next day only
    assert [d.date for d in memory(workdir).days] == ["1987-03-02", "1987-03-04"]
    refused(learn(monim, source, workdir, model, "--relearn", "1987-03-03"), "relearn 1987-03-03", "last day (1987-03-04)")
    from monim.core.run_config import RunConfig
    from monim.plan import last_read

    assert last_read(RunConfig(source=str(source), workdir=str(workdir), policy="fullmem")) == dt.date(1987, 3, 4)


@pytest.mark.slow
def test_an_id_names_one_article_across_the_stream(monim, learned, model, tmp_path):
    source, workdir = copy(monim, learned, tmp_path)
    rows = demo_rows(3, 3)
    reused = memory(workdir).shards.shard_docs(memory(workdir).days[0].shard)[0]  # an article of 1987-03-02, learned
    write_feed(source, [r for r in rows] + [{"id": reused, "date": "1987-03-04", "text": "Another story, the same id."}])
    refused(learn(monim, source, workdir, model, "--start", "1987-03-04"), f"{source}:10: field 'id'", f"{reused!r} again",
            "learned an article of 1987-03-02")
    assert len(memory(workdir).days) == 2  # nothing written
    out = monim.last_json(learn(monim, source, workdir, model, "--start", "1987-03-04", "--on-error", "skip", "--json"))
    (row,) = out["rows"]
    assert row["docs_skipped"] == 1 and row["docs_records"] == 4
    before = {d.date: d.entries for d in memory(workdir).days}
    forget = monim.last_json(monim("forget", "--workdir", workdir, "--doc", reused, "--json", check=False))
    after = {d.date: d.entries for d in memory(workdir).days}
    assert after["1987-03-04"] == before["1987-03-04"] and after["1987-03-02"] == before["1987-03-02"] - forget["removed"]["fullmem"]


@pytest.mark.slow
def test_every_record_counted_once_and_late_articles_named_where_their_day_is_read(monim, learned, model, tmp_path):
    source, workdir = copy(monim, learned, tmp_path)
    rows = demo_rows(3, 3)
    learned_days = [r for r in rows if r["date"] < "1987-03-04"]
    late = {"id": "wire", "date": "1987-03-03", "text": "A story filed after its day was learned."}
    bad_end = json.dumps({"id": "x", "date": "1987-03-04", "text": ""})  # a bad record at a day's end
    lines = [*learned_days, late, *[r for r in rows if r["date"] == "1987-03-04"], bad_end, "{broken"]
    write_feed(source, lines[: len(learned_days) + 1])  # the learned days, then a late arrival for the last
    rerun = learn(monim, source, workdir, model, "--end", "1987-03-03")  # a re-run of a learned range names it
    assert rerun.returncode == 0 and "wire (1987-03-03)" in rerun.stderr and "0 to learn" in rerun.stderr, rerun.stderr[-3000:]
    status = monim.last_json(monim("status", "--workdir", workdir, "--source", source, "--json", check=False))
    assert status["late"] == {"1987-03-03": [["wire", "1987-03-03"]]}
    write_feed(source, lines)
    out = monim.last_json(learn(monim, source, workdir, model, "--on-error", "skip", "--json"))
    counted = {r["date"]: r["docs_records"] for r in out["rows"]}
    assert counted == {"1987-03-02": 3, "1987-03-03": 3, "1987-03-04": 5}  # 3 articles and 2 bad records
    assert sum(counted.values()) + len(status["late"]["1987-03-03"]) == len(lines)  # each record once, "wire" after 03-03


@pytest.mark.slow
def test_a_range_that_cannot_be_learned_is_refused_before_any_work(monim, model, tmp_path):
    """A per-day folder: a bad record in a day after --end refuses nothing (case 6); a day before the
    memory's last is refused at planning, no LM pass, nothing written (case 5)."""
    rows, folder = demo_rows(3, 3), tmp_path / "feed"
    folder.mkdir()
    for date in sorted({r["date"] for r in rows}):
        write_feed(folder / f"{date}.jsonl", [r for r in rows if r["date"] == date])
    with open(folder / "1987-03-04.jsonl", "a") as f:
        f.write(json.dumps(rows[0]) + "\n")  # an id met twice, after the range
    workdir = tmp_path / "w"
    assert learn(monim, folder, workdir, model, "--start", "1987-03-03", "--end", "1987-03-03").returncode == 0
    before = sorted(p.relative_to(workdir) for p in (workdir / "memories").rglob("*"))
    refused(learn(monim, folder, workdir, model, "--start", "1987-03-02", "--end", "1987-03-02"), "start: 1987-03-02 comes before",
            "1987-03-03")
    assert sorted(p.relative_to(workdir) for p in (workdir / "memories").rglob("*")) == before  # no stray
    assert monim("fsck", "--workdir", workdir, check=False).returncode == 0


@pytest.mark.slow
def test_meaningless_settings_and_dates_are_refused_naming_the_field(monim, learned, model, tmp_path):
    source, workdir = learned
    refused(learn(monim, source, tmp_path / "a", model, "--delta", "-inf"), "delta", "finite")
    refused(learn(monim, source, tmp_path / "b", model, "--delta", "nan"), "delta", "finite")
    refused(learn(monim, source, tmp_path / "c", model, "--start", "1987-03-04", "--end", "1987-03-02"),
            "--start 1987-03-04 is after --end 1987-03-02")
    assert not any((tmp_path / w).exists() for w in "abc")
    refused(monim("forget", "--workdir", workdir, "--day", "1987-3-2", check=False), "not a date", "1987-3-2")
    refused(monim("generate", "--workdir", workdir, "--prompt", "The", "--as-of", "1987-03-01", check=False), "--as-of 1987-03-01",
            "first day is 1987-03-02")


@pytest.mark.parametrize("params, field", [({"seed": 1e30}, "seed"), ({"temperature": math.inf}, "temperature"),
                                           ({"temperature": math.nan}, "temperature"), ({"seed": -1}, "seed"),
                                           ({"top_p": math.nan}, "top_p")])
def test_a_served_request_with_a_meaningless_param_is_refused_naming_it(params, field):
    from monim.serving.service import BadRequest, Limits, parse

    with pytest.raises(BadRequest, match=rf"params: {field} must"):
        parse({"dataframe_records": [{"prompt": "Hi"}], "params": params}, Limits())


@pytest.mark.parametrize("make, field", [
    (lambda: __import__("monim.core.run_config").core.run_config.RunConfig(delta=-math.inf), "delta"),
    (lambda: __import__("monim.core.run_config").core.run_config.RunConfig(rate=math.nan), "rate"),
    (lambda: __import__("monim.core.config").core.config.CalibratorConfig(skip_threshold=math.nan), "skip_threshold"),
    (lambda: __import__("monim.core.recency").core.recency.Recency(half_life=math.inf), "half_life")])
def test_a_non_finite_setting_is_refused_naming_it(make, field):
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.slow
def test_a_record_no_text_can_hold_is_named_and_skipped_and_the_stream_goes_on(monim, learned, model, tmp_path):
    """A lone surrogate escape (`"\\ud800"`, valid JSON) in a record's text (issue 65, case 4): refused naming its
    file, line and field, or with --on-error skip named in the run's log and skipped; its day is learned (an odd but
    readable article with it), and so is the next."""
    source, workdir = copy(monim, learned, tmp_path)
    rows = demo_rows(4, 3)
    odd = {"id": "odd", "date": "1987-03-04", "text": "Control \x01 characters \u2028 and a noncharacter \uffff are text."}
    lines = [*(r for r in rows if r["date"] <= "1987-03-04"), odd, '{"id": "s", "date": "1987-03-04", "text": "a \\ud800"}']
    write_feed(source, lines)
    said = f"{source}:{len(lines)}: field 'text': a lone surrogate (U+D800) at character 3"
    refused(learn(monim, source, workdir, model), said)
    skip = learn(monim, source, workdir, model, "--on-error", "skip", "--json")
    assert skip.returncode == 0 and said in skip.stderr, skip.stderr[-3000:]
    row = {r["date"]: r for r in monim.last_json(skip)["rows"]}["1987-03-04"]
    assert (row["docs_skipped"], row["docs_train"] + row["docs_validation"] + row["docs_test"], row["docs_records"]) == (1, 4, 5)
    write_feed(source, lines + [r for r in rows if r["date"] > "1987-03-04"])
    after = learn(monim, source, workdir, model, "--on-error", "skip", "--start", "1987-03-05", "--json")
    assert after.returncode == 0 and [r["date"] for r in monim.last_json(after)["rows"]] == ["1987-03-05"], after.stderr[-3000:]
    assert [d.date for d in memory(workdir).days] == ["1987-03-02", "1987-03-03", "1987-03-04", "1987-03-05"]


@pytest.mark.slow
def test_a_copied_work_directory_answers_from_its_own_memory(monim, model, tmp_path):
    """A backup (`cp -a`) of a work directory: its champion, found and loaded as `monim serve-model` does,
    or by MLflow's own client through the backup's store, reads the backup's memory, with the original
    in place and after it is gone."""
    import mlflow

    from tracking.served_model import load_theta
    from tracking.versions import find_version

    original, backup = tmp_path / "w", tmp_path / "backup"
    assert learn(monim, write_feed(tmp_path / "feed.jsonl", demo_rows(3, 3)), original, model, "--end", "1987-03-03").returncode == 0
    subprocess.run(["cp", "-a", original, backup], check=True)
    uri, memory = f"sqlite:///{backup.resolve() / 'mlflow.db'}", (backup / "memories" / "fullmem").resolve()
    found = find_version(uri, memory)
    assert found["memory"] == str(memory) and found["uri"].startswith(backup.resolve().as_uri())
    assert load_theta(found).ds.root == memory
    mlflow.set_tracking_uri(uri)
    try:
        own = mlflow.pyfunc.load_model(f"models:/{found['model']}@champion")
        assert own.unwrap_python_model().memory.ds.root == memory
    finally:
        mlflow.set_tracking_uri(None)
    shutil.rmtree(original)
    assert load_theta(find_version(uri, memory)).ds.root == memory
