"""What a daily job meets: a mis-dated record, a stop, a changed model or window, a damaged file, a bad
input. Each is named in one line and contained: the memory afterwards is a clean run's, or the
command refused before any work."""

import datetime as dt
import json
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from cli.errors import NO_ROOM
from helpers import FAILED, demo_rows, fingerprint, learn, refused, write_feed
from monim.storage.datastore import Datastore


def feed(path: Path, days: int = 3, per_day: int = 3, extra: list[dict] = ()) -> Path:
    """A small JSONL feed: the demo's first articles of its first days, and extra records at the end."""
    return write_feed(path, [*demo_rows(days, per_day), *extra])


def arrays(workdir: Path) -> tuple[list[str], dict]:
    ds = Datastore.read(workdir / "memories" / "fullmem")
    return [d.date for d in ds.days], {a: ds.shards.array(a) for a in ("keys", "values", "positions")}


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def clean(monim, model, tmp_path_factory):
    """The reference: three days learned without a fault."""
    root = tmp_path_factory.mktemp("clean")
    proc = learn(monim, feed(root / "feed.jsonl"), root / "w", model)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "w"


def same_memory(a: Path, b: Path, days: int | None = None) -> bool:
    (da, xa), (db, xb) = arrays(a), arrays(b)
    n = len(da) if days is None else days
    if da[:n] != db[:n]:
        return False
    cut = sum(d.entries for d in Datastore.read(b / "memories" / "fullmem").days[:n])
    return all(np.array_equal(xa[k], xb[k][:cut]) for k in xa)


@pytest.mark.slow
def test_a_record_dated_after_today_is_refused_skipped_or_undone(monim, model, clean, tmp_path):
    future = {"id": "x", "date": (dt.date.today() + dt.timedelta(days=400)).isoformat(), "text": "A record from later."}
    source = feed(tmp_path / "feed.jsonl", extra=[future])
    refused(learn(monim, source, tmp_path / "w", model), "after today", "--on-error skip")
    assert not (tmp_path / "w" / "memories").exists()  # refused before any work
    assert learn(monim, source, tmp_path / "w", model, "--on-error", "skip").returncode == 0
    assert same_memory(tmp_path / "w", clean)
    # a bad day already committed (here: the last one) is undone by forgetting it, and learned again only by name
    assert monim("forget", "--workdir", tmp_path / "w", "--day", "1987-03-04", check=False).returncode == 0
    days, _ = arrays(tmp_path / "w")
    assert days == ["1987-03-02", "1987-03-03"]
    assert learn(monim, source, tmp_path / "w", model, "--on-error", "skip").returncode == 0
    assert arrays(tmp_path / "w")[0] == ["1987-03-02", "1987-03-03"]  # forgotten: not learned again
    assert learn(monim, source, tmp_path / "w", model, "--on-error", "skip", "--relearn", "1987-03-04").returncode == 0
    assert same_memory(tmp_path / "w", clean)
    assert monim("fsck", "--workdir", tmp_path / "w", check=False).returncode == 0


@pytest.mark.slow
def test_sigterm_stops_a_learn_within_ten_seconds_at_any_point_twenty_times(monim, model, clean, tmp_path):
    """At random points (Prefect's start-up, a day's tasks, between days), 20 times over one work
    directory: each stop takes under 10 s, leaves no process, and whole days from the first."""
    import psutil

    source = feed(tmp_path / "feed.jsonl", days=6, per_day=2)
    rng = random.Random(0)
    for trial in range(20):
        workdir = tmp_path / f"w{trial % 4}"
        own = trial % 5 == 0  # now and then a command that starts its own Prefect API
        proc = subprocess.Popen([monim.script, "learn", "--source", source, "--workdir", workdir, "--model", model,
                                 "--policy", "fullmem"], env=monim.env(own_api=own),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, 9.0))
        children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        assert time.monotonic() - started < 10
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, (trial, [p.cmdline() for p in alive])
        if (workdir / "memories" / "fullmem" / "manifest.json").exists():
            days, _ = arrays(workdir)
            assert days == ["1987-03-02", "1987-03-03", "1987-03-04", "1987-03-05", "1987-03-06", "1987-03-07"][: len(days)]


@pytest.mark.slow
def test_a_changed_model_or_window_is_refused_before_any_work(monim, prefect, model, clean, tmp_path):
    """New weights of the same shape at the same path, or another window through the run's cfg:
    refused naming the field, nothing learned, no feature of the new weights kept."""
    from flows.stream import learn_stream
    from monim.core.run_config import RunConfig

    changed = tmp_path / "model"
    shutil.copytree(model, changed)
    workdir = tmp_path / "w"
    source = feed(tmp_path / "feed.jsonl", days=2)
    assert learn(monim, source, workdir, changed, "--end", "1987-03-02").returncode == 0
    from safetensors.torch import load_file, save_file

    weights = load_file(changed / "model.safetensors")
    weights[next(iter(weights))] += 0.5
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    before = sorted(p.relative_to(workdir) for p in workdir.rglob("*") if "features" in p.parts)
    refused(learn(monim, source, workdir, changed), "field 'weights'")
    assert sorted(p.relative_to(workdir) for p in workdir.rglob("*") if "features" in p.parts) == before
    assert arrays(workdir)[0] == ["1987-03-02"]
    other = tmp_path / "other"
    shutil.copytree(clean, other)
    cfg = RunConfig(source=str(feed(tmp_path / "longer.jsonl", days=4)), workdir=str(other), model=str(model),
                     policy="fullmem", stride=256)
    with pytest.raises(Exception, match="field 'window.stride': learned with 512, not 256"):
        learn_stream(cfg)  # the deployment's path: the flow refuses at its start
    assert arrays(other)[0] == arrays(clean)[0]


@pytest.mark.slow
def test_fsck_raises_no_false_alarm_and_finds_and_mends_damage(monim, model, clean, tmp_path):
    workdir = tmp_path / "w"
    shutil.copytree(clean, workdir)  # a copied work directory: a warning, not a fault
    proc = monim("fsck", "--workdir", workdir, "--json", check=False)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and all(p.get("warning") for p in report["problems"]), report
    for _ in range(2):  # repaired once; the second run has nothing to do and logs nothing again
        assert monim("fsck", "--workdir", workdir, "--repair", check=False).returncode == 0
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    run = c.search_runs([e.experiment_id for e in c.search_experiments()], "attributes.run_name = 'fullmem'")[0]
    steps = [m.step for m in c.get_metric_history(run.info.run_id, "8_data/docs_train")]
    assert sorted(steps) == sorted(set(steps))  # each day logged once
    root = workdir / "memories" / "fullmem"
    theta = Datastore.read(root).manifest["thetas"][-1]
    (root / theta["dir"] / "calibrator.pt").unlink()  # a lost calibrator: Θ cannot read it
    proc = monim("fsck", "--workdir", workdir, "--json", check=False)
    assert proc.returncode == 1 and "calibrator.pt missing" in proc.stdout
    assert monim("fsck", "--workdir", workdir, "--repair", check=False).returncode == 0  # trained again from its window
    assert monim("fsck", "--workdir", workdir, check=False).returncode == 0
    keys = sorted((root / "shards").glob("*/keys.npy"))[0]
    data = bytearray(keys.read_bytes())
    data[-3] ^= 0x10
    keys.write_bytes(bytes(data))
    refused(learn(monim, feed(tmp_path / "feed.jsonl", days=4), workdir, model), "fails its checks", "keys.npy",
             "monim fsck", status=FAILED)


@pytest.mark.slow
def test_errors_are_one_line_naming_the_file(monim, model, clean, tmp_path):
    workdir = tmp_path / "w"
    shutil.copytree(clean, workdir)
    manifest = workdir / "memories" / "fullmem" / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])  # truncated
    refused(monim("status", "--workdir", workdir, check=False), "manifest.json", "line", "column", status=FAILED)
    manifest.write_text(text)
    (workdir / "mlflow.db").write_bytes(b"not a database" * 100)
    refused(learn(monim, feed(tmp_path / "feed.jsonl", days=4), workdir, model), "mlflow.db", "damaged")
    (tmp_path / "file").write_text("")
    refused(learn(monim, feed(tmp_path / "feed.jsonl"), tmp_path / "file", model), "is a file")
    prefect = tmp_path / "p"
    shutil.copytree(clean, prefect, ignore=shutil.ignore_patterns("mlflow.db"))
    (prefect / "prefect").mkdir(exist_ok=True)
    (prefect / "prefect" / "prefect.db").write_bytes(b"not a database" * 100)
    refused(learn(monim, feed(tmp_path / "feed.jsonl", days=4), prefect, model, own_api=True), "prefect.db", "damaged", status=FAILED)


@pytest.mark.slow
def test_input_is_never_changed_silently(monim, model, clean, tmp_path):
    dup = {"id": "1914", "date": "1987-03-04", "text": "An article under an id met before."}
    source = feed(tmp_path / "dup.jsonl", extra=[])
    rows = source.read_text().splitlines()
    first = json.loads(rows[0])["id"]
    source.write_text("\n".join(rows + [json.dumps(dup | {"id": first})]) + "\n")
    refused(learn(monim, source, tmp_path / "w", model), "field 'id'", "dup.jsonl:1 has the same id")
    nameless = feed(tmp_path / "nameless.jsonl", extra=[{"date": "1987-03-04", "text": "A record without an id."}])
    refused(learn(monim, nameless, tmp_path / "n", model), "field 'id': missing", "--missing-id hash")
    assert learn(monim, nameless, tmp_path / "n", model, "--missing-id", "hash").returncode == 0
    refused(monim("forget", "--workdir", clean, "--doc", "no-such-id", check=False), "no-such-id")
    skipping = feed(tmp_path / "skip.jsonl")
    skipping.write_text(skipping.read_text().replace("\n", "\n{broken\n", 1))
    out = learn(monim, skipping, tmp_path / "s", model, "--on-error", "skip", "--json")
    rows = json.loads(out.stdout.strip().splitlines()[-1])["rows"]
    assert out.returncode == 0 and rows[0]["docs_skipped"] == 1


def files(workdir: Path) -> dict[str, tuple]:
    """Every path of a work directory with its size, modification time and inode."""
    return {str(p): (s.st_size, s.st_mtime_ns, s.st_ino) for p in [workdir, *workdir.rglob("*")] for s in [p.stat()]}


def no_growth() -> None:
    """A file-size limit of 0 bytes (`ulimit -f 0`): any write fails (EFBIG), as on a full disk."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


@pytest.mark.slow
def test_fsck_names_a_half_finished_day_and_repair_finishes_it_as_an_uninterrupted_learn(monim, model, clean, tmp_path):
    """A learn stopped right after its commit (the recipe's stages up to it, run here): fsck, which writes
    nothing and runs where nothing can be written, names each missing piece; --repair finishes the day,
    and the memory is the uninterrupted learn's."""
    from monim.core.run_config import RunConfig
    from monim.plan import plan
    from monim.run import open_run
    from tracking.store import client

    source, workdir, date = feed(tmp_path / "feed.jsonl"), tmp_path / "w", "1987-03-04"
    assert learn(monim, source, workdir, model, "--end", "1987-03-03").returncode == 0
    cfg = RunConfig(source=str(source), workdir=str(workdir), model=str(model), policy="fullmem")
    run = open_run(cfg)
    day = run.ingest(dt.date.fromisoformat(date), plan(cfg).since(dt.date.fromisoformat(date)))
    run.featurize(day)
    run.memorize(day)  # committed; then the process dies (kill -9): no calibration, row, version or step
    assert arrays(workdir)[0][-1] == date
    before = files(workdir)
    proc = monim("fsck", "--workdir", workdir, "--json", check=False, preexec_fn=no_growth)
    assert files(workdir) == before  # nothing written, not even a lock holder
    problems = [p for p in monim.last_json(proc, succeeded=False)["problems"] if not p.get("warning")]
    assert proc.returncode == 1 and [p["what"] for p in problems] == [
        f"day {date} committed but not calibrated, not evaluated, not registered, not logged to MLflow"], problems
    assert monim("fsck", "--workdir", workdir, "--repair", check=False).returncode == 0
    assert monim("fsck", "--workdir", workdir, check=False).returncode == 0
    root = workdir / "memories" / "fullmem"
    assert fingerprint(root) == fingerprint(clean / "memories" / "fullmem")
    assert json.loads((workdir / "runs" / "fullmem.json").read_text()).keys() == {"1987-03-02", "1987-03-03", date}
    (version,) = [v for v in client(f"sqlite:///{workdir / 'mlflow.db'}").search_model_versions("")
                  if v.tags["monim.as_of"] == date]
    assert version.tags["monim.checksum"] == Datastore.read(root).checksum(date)


@pytest.mark.slow
def test_a_learn_out_of_room_names_the_file_and_says_what_the_memory_holds(monim, model, tmp_path):
    """A file-size limit (`ulimit -f`; a full disk fails the same writes). 4 KiB: the first file the learn
    writes (a check's cache, MLflow's journal) does not fit, and the stream stops before any work. 256 KiB, MLflow behind its
    server: the day's features and shard fit, what its calibration writes does not, and the stream stops
    after the commit. One line each, exit status 74, and what it says of the memory is what the memory holds."""
    import resource

    from servers import local

    source, workdir, date = feed(tmp_path / "feed.jsonl"), tmp_path / "w", "1987-03-04"
    assert learn(monim, source, workdir, model, "--end", "1987-03-03").returncode == 0

    def memory() -> dict[str, bytes]:  # every file of the memory but the lock holders' notes
        return {str(p): p.read_bytes() for p in (workdir / "memories").rglob("*")
                if p.is_file() and not p.name.endswith((".holder", ".checked.json"))}

    def limited(size: int, *more) -> subprocess.CompletedProcess:
        return monim("learn", "--source", source, "--workdir", workdir, "--model", model, "--policy", "fullmem", *more,
                     check=False, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (size, size)))

    before = memory()
    proc = limited(4096)
    refused(proc, f"the file-size limit is reached (ulimit -f) while writing {workdir.resolve()}/",
             f"the memory is unchanged (day {date} not committed)", status=NO_ROOM)
    assert memory() == before
    server = local.mlflow_server(port := local.free_port(), workdir)  # its store beyond the limit
    try:
        uri = f"http://127.0.0.1:{port}"
        proc = limited(256 * 1024, "--tracking-uri", uri)
        refused(proc, f"the file-size limit is reached (ulimit -f) while writing {workdir.resolve()}/memories/fullmem/",
                 f"day {date} is committed; it is not calibrated, not evaluated, not registered, not logged to MLflow",
                 f"monim fsck --workdir {workdir} --repair", status=NO_ROOM)
        assert arrays(workdir)[0][-1] == date
        fsck = monim("fsck", "--workdir", workdir, "--tracking-uri", uri, "--json", check=False)
        assert fsck.returncode == 1 and f"day {date} committed but not calibrated, not evaluated" in fsck.stdout
        assert monim("fsck", "--workdir", workdir, "--tracking-uri", uri, "--repair", check=False).returncode == 0
        assert monim("fsck", "--workdir", workdir, "--tracking-uri", uri, check=False).returncode == 0
    finally:
        local.stop([server])


def test_a_prefect_database_that_cannot_be_read_for_want_of_room_is_said_so_not_damaged(tmp_path):
    """Under a file-size limit a WAL database cannot be read (its shared-memory file cannot grow): that is
    no room, said as such (the learn's exit status 74), not 'damaged, move it aside'."""
    import resource
    import sqlite3
    import sys

    db = sqlite3.connect(tmp_path / "prefect.db")
    db.execute("PRAGMA journal_mode=wal")
    db.execute("CREATE TABLE t (x)")
    db.executemany("INSERT INTO t VALUES (?)", [("x" * 100,)] * 100)
    db.commit()
    db.close()  # its -wal and -shm files go
    proc = subprocess.run([sys.executable, "-c", "import servers.local as s; s.prefect_api()"], capture_output=True,
                          text=True, env={**__import__("os").environ, "PREFECT_HOME": str(tmp_path)},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)))
    said = proc.stderr.splitlines()[-1]
    assert "Prefect's API did not start" in said and "the file-size limit is reached" in said, proc.stderr[-2000:]
    assert "damaged" not in said
