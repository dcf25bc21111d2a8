"""Nothing a user or the machine does loses a day: atomic writes, a full disk, one writer at a time."""

import datetime as dt
import errno
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import random_entries
from monim.core.atomic import DiskFull, is_stray, replacing, write_json
from monim.core.lock import Locked, hold
from monim.storage.datastore import Datastore
from monim.storage.entries import Entries

D = 8


def test_a_failed_write_leaves_what_was_there(tmp_path):
    path = tmp_path / "state.json"
    write_json(path, {"day": 1})
    with pytest.raises(RuntimeError):
        with replacing(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert json.loads(path.read_text()) == {"day": 1} and os.listdir(tmp_path) == ["state.json"]


KILL_MID_SCHEMA = """
import os, signal, sys
import sqlalchemy
@sqlalchemy.event.listens_for(sqlalchemy.engine.Engine, "after_cursor_execute")
def kill_in_the_first_table_rebuild(conn, cursor, statement, *args):
    if statement.lstrip().startswith("CREATE TABLE _alembic_tmp_"):
        os.kill(os.getpid(), signal.SIGKILL)
uri = "sqlite:///" + sys.argv[2]
if sys.argv[1] == "monim":
    from tracking.store import client
    client(uri)
else:
    from mlflow.tracking import MlflowClient
    MlflowClient(tracking_uri=uri).search_experiments()
"""


@pytest.mark.parametrize("maker", ["mlflow", "monim"])
def test_a_store_killed_while_mlflow_makes_its_schema(tmp_path, maker):
    """MLflow alone leaves a half-made SQLite store that no later run opens; monim's is whole or absent."""
    db = tmp_path / "mlflow.db"
    killed = subprocess.run([sys.executable, "-c", KILL_MID_SCHEMA, maker, str(db)], cwd=Path(__file__).parents[1])
    assert killed.returncode == -9
    if maker == "mlflow":
        assert db.exists()
        with pytest.raises(Exception, match="OperationalError"):
            from mlflow.tracking import MlflowClient

            MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
        return
    assert not db.exists() and all(is_stray(p) for p in tmp_path.iterdir())
    from tracking.store import client

    assert [e.name for e in client(f"sqlite:///{db}").search_experiments()] == ["Default"]


def test_a_full_disk_during_a_commit_leaves_the_memory_unchanged(tmp_path, monkeypatch):
    ds = Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"})
    ds.commits.commit_day("2022-06-01", random_entries(10), 20, "fullmem")
    manifest = (tmp_path / "manifest.json").read_bytes()
    real_save = np.save

    def full(file, arr, *args, **kwargs):  # the disk fills up in the middle of the shard's second array
        if str(file).endswith("values.npy"):
            with open(file, "wb") as f:
                f.write(b"\x93NUMPY")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(file, arr, *args, **kwargs)

    monkeypatch.setattr(np, "save", full)
    with pytest.raises(DiskFull, match="the disk is full while writing .*unchanged"):
        ds.commits.commit_day("2022-06-02", random_entries(7, 1), 20, "fullmem")
    monkeypatch.undo()
    assert (tmp_path / "manifest.json").read_bytes() == manifest
    assert [p.name for p in (tmp_path / "shards").iterdir()] == [ds.days[0].shard]  # no half-written shard
    assert Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"}).commits.commit_day("2022-06-02", random_entries(7, 1), 20, "fullmem")


def test_a_commit_records_each_shard_file_checksum(tmp_path):
    ds = Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"})
    ds.commits.commit_day("2022-06-01", random_entries(10), 20, "fullmem")
    folder = tmp_path / "shards" / ds.days[0].shard
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["docs.json", "docs.npy", "ids.npy", "keys.npy", "positions.npy", "values.npy"]
    assert ds.days[0].checksums == {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in files}


HOLDER = "import sys, time\nfrom monim.core.lock import hold\nwith hold(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(float(sys.argv[2]))\n"


def holder(lock, seconds):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_lock_names_its_holder_and_a_dead_holder_frees_it(tmp_path):
    lock = tmp_path / "memory" / ".lock"
    proc = holder(lock, 60)
    with pytest.raises(Locked, match=f"being written by pid {proc.pid} on .* since .*-c"):
        with hold(lock, wait=False):
            pass
    proc.kill()  # kill -9: the kernel drops its lock
    proc.wait()
    with hold(lock, wait=False):
        with hold(lock, wait=False):  # re-entrant in one process (a flow and its tasks)
            pass


def test_a_second_writer_waits_and_says_for_whom(tmp_path):
    lock = tmp_path / ".lock"
    proc = holder(lock, 2)
    said: list[str] = []
    started = time.monotonic()
    with hold(lock, say=said.append, every=0.5):
        waited = time.monotonic() - started
    proc.wait()
    assert waited > 0.5 and said and all(f"pid {proc.pid}" in s for s in said)


def test_a_writer_reads_what_another_committed_before_writing(tiny, tmp_path):
    """Two handles opened before either wrote (two processes): the second sees the first's day under the lock."""
    from monim.core.config import DEMO_STREAM
    from monim.data.feed import open_feed
    from monim.data.stream import iter_days
    from monim.learning.memorize import memorize_day
    from monim.learning.policies import make_policy
    from monim.theta.memory import Memory

    days = [d for d in iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 2), dt.date(1987, 3, 3))]
    days = [type(d)(d.date, d.train[:2], [], []) for d in days]
    first, second = Memory(tmp_path / "m", tiny), Memory(tmp_path / "m", tiny)
    alone = Memory(tmp_path / "alone", tiny)
    assert memorize_day(first, days[0], make_policy("fullmem")).committed
    assert not memorize_day(second, days[0], make_policy("fullmem")).committed  # already there: nothing changed
    assert memorize_day(second, days[1], make_policy("fullmem")).committed
    for day in days:
        memorize_day(alone, day, make_policy("fullmem"))
    reopened = Datastore.read(tmp_path / "m")
    assert [d.date for d in reopened.days] == ["1987-03-02", "1987-03-03"]
    for array in ("keys", "values", "ids", "positions"):
        np.testing.assert_array_equal(reopened.shards.array(array), alone.ds.shards.array(array))


def test_fsck_finds_a_flipped_byte_strays_and_a_stale_index_and_repairs_what_is_derived(random_datastore, tmp_path):
    import faiss

    from monim.storage.fsck import check_memory
    from monim.storage.index import IndexConfig, MemoryIndex

    ds = random_datastore((300, 200))
    manifest = json.loads((tmp_path / "manifest.json").read_text())  # an IVF-PQ memory: its index on disk
    settings = {"index": {"exact_below": 400, "code_bytes": 4, "nprobe": 4}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest | {"settings": settings}))
    ds = Datastore.read(tmp_path)
    index = MemoryIndex(tmp_path, D, IndexConfig(exact_below=400, code_bytes=4, nprobe=4))
    index.sync(ds)
    assert check_memory(tmp_path) == []
    index.index.remove_ids(faiss.IDSelectorBatch(np.array([3], np.int64)))  # an index that lost an entry
    index._save()
    (tmp_path / "shards" / ".tmp-1234-crashed").mkdir()
    (tmp_path / "theta" / "2022-06-02-abcd1234").mkdir(parents=True)  # a calibration whose commit never happened
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "2022-06-03.npz").write_bytes(b"")  # the sample of a day never committed
    problems = check_memory(tmp_path)
    assert sorted(p.what.split(" (")[0] for p in problems) == ["index holds 499 entries"] + ["stray"] * 3
    fixed = check_memory(tmp_path, repair=True)
    assert all(p.repaired for p in fixed) and check_memory(tmp_path) == []
    assert sorted(os.listdir(tmp_path / "shards")) == sorted(d.shard for d in ds.days)
    # one flipped byte in a shard: found, named by day and entries, and not repairable
    keys = tmp_path / "shards" / ds.days[1].shard / "keys.npy"
    data = bytearray(keys.read_bytes())
    data[-5] ^= 0x01
    keys.write_bytes(bytes(data))
    (problem,) = check_memory(tmp_path, repair=True)
    assert problem.repair is None and not problem.repaired
    assert "keys.npy corrupt" in problem.what and "day 2022-06-02: 200 entries lost" in problem.what


def test_the_manifest_says_which_days_are_evaluated_and_the_run_record_is_its_view(tiny, tmp_path):
    """A day's row lives in its memory's manifest (only for a committed day); runs/<name>.json is
    rewritten from it, and fsck finds a record that differs and rewrites it."""
    from monim.storage.fsck import check_rows
    from monim.storage.workdirs import read_rows, rows_file, write_row
    from monim.theta.memory import Memory

    memory = Memory(tmp_path / "memories" / "fullmem", tiny)
    day = Entries(np.zeros((5, tiny.hidden_size), np.float16), np.arange(5, dtype=np.int32), ["d"] * 5, np.arange(5))
    memory.ds.commits.commit_day("2022-06-01", day, 5, "fullmem")
    row = {"date": "2022-06-01", "ppl": 12.5, "step": 0}
    with pytest.raises(ValueError, match="2022-06-02 is not committed"):
        write_row(tmp_path, "fullmem", {"date": "2022-06-02", "ppl": 1.0}, memory.ds)
    write_row(tmp_path, "fullmem", row, memory.ds)
    assert Datastore.read(memory.ds.root).evaluations() == {"2022-06-01": row} == read_rows(tmp_path, "fullmem")
    view = rows_file(tmp_path, "fullmem")
    assert json.loads(view.read_text()) == {"2022-06-01": row} and check_rows(tmp_path) == []
    write_json(view, {})  # the view lost (an old record, a crash between the two writes)
    (problem,) = check_rows(tmp_path, repair=True)
    assert "2022-06-01 evaluated in the memory but not recorded" in problem.what and problem.repaired
    assert json.loads(view.read_text()) == {"2022-06-01": row} and check_rows(tmp_path) == []
    write_json(view, {"2022-06-01": row, "2022-06-02": row})
    (problem,) = check_rows(tmp_path)
    assert "2022-06-02 recorded but not evaluated" in problem.what and not problem.repaired
    # replacing the last day forgets its evaluation; the bare LM's record is its own truth
    memory.ds.commits.commit_day("2022-06-01", day, 5, "fullmem", force=True)
    assert read_rows(tmp_path, "fullmem") == {}
    write_row(tmp_path, "bare", row, None)
    assert read_rows(tmp_path, "bare") == {"2022-06-01": row}


def test_theta_history_is_kept_once(random_datastore, tmp_path):
    """Θ's latest settings are the last of its history; an older manifest's copy of them is dropped."""
    ds = random_datastore((5, 5))
    first, second = ({"lam": lam, "temperature": 1.0, "date": d, "dir": f"theta/{d}"} for lam, d in
                     ((0.2, "2022-06-01"), (0.3, "2022-06-02")))
    ds.commits.set_theta(first)
    ds.commits.set_theta(second)
    ds.commits.set_theta(second | {"lam": 0.4})  # the day calibrated again
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert "theta" not in manifest and manifest["thetas"] == [first, second | {"lam": 0.4}]
    assert ds.theta_at()["lam"] == 0.4 and ds.theta_at("2022-06-01") == first
    write_json(tmp_path / "manifest.json", manifest | {"theta": first})  # as older versions wrote it
    old = Datastore.read(tmp_path)
    assert "theta" not in old.manifest and not old.reload() and old.theta_at()["lam"] == 0.4


def test_a_reader_on_a_read_only_mount_syncs_a_stale_index_without_writing(tiny, tmp_path, monkeypatch):
    """No lock file, no index saved: the memory folder is not writable (access(2) says so)."""
    import monim.theta.searcher
    from monim.theta.memory import Memory

    root = tmp_path / "m"
    n = 40
    keys = np.random.default_rng(0).standard_normal((n, tiny.hidden_size)).astype(np.float16)
    Datastore.for_lm(root, tiny).commits.commit_day("2022-06-01", Entries(keys, np.arange(n, dtype=np.int32), ["d"] * n,
                                                                  np.arange(n, dtype=np.int32)), n, "fullmem")
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    monkeypatch.setattr(monim.theta.searcher.os, "access", lambda path, mode: Path(path) != root)
    memory = Memory(root, tiny)
    memory.sync()
    assert memory.index.ntotal == n and sorted(p.relative_to(root) for p in root.rglob("*")) == before
    _, values = memory.neighbors(keys[:3].astype(np.float32), k=1)
    np.testing.assert_array_equal(values[:, 0], [0, 1, 2])  # each key finds itself


def two_days(root: Path, lm):
    """A memory of two committed days of 6 random entries each (the tiny LM's key size)."""
    from monim.theta.memory import Memory

    memory = Memory(root, lm)
    for i, date in enumerate(("2022-06-01", "2022-06-02")):
        rng = np.random.default_rng(i)
        memory.ds.commits.commit_day(date, Entries(rng.standard_normal((6, lm.hidden_size)).astype(np.float16),
                                           rng.permutation(50).astype(np.int32)[:6], ["d"] * 6, np.arange(6)), 6, "fullmem")
    return memory


def test_a_memory_whose_files_differ_from_their_commit_is_never_answered_from(tiny, tmp_path):
    """Every reader opens Θ by Memory.open, which reads each shard Θ reads against its commit's
    checksums first: a values.npy rewritten in place (same shape and dtype, reversed) is refused
    naming the file and the day, as is the MLflow model's load; the days before it still open as of
    their day; forgetting the day is the way out; a truncated array names its file and day."""
    from types import SimpleNamespace

    from monim.core.manifest import Damaged
    from monim.theta.memory import Memory
    from tracking.served_model import MonimModel

    memory = two_days(tmp_path, tiny)
    assert len(Memory.open(tmp_path, tiny)) == 12
    folder = tmp_path / "shards" / memory.ds.days[1].shard
    values = np.load(folder / "values.npy")
    np.save(folder / "values.npy", values[::-1].copy())  # in place: same shape and dtype, other bytes
    assert np.load(folder / "values.npy").shape == values.shape and not np.array_equal(np.load(folder / "values.npy"), values)
    refusal = r"shards/{}: values.npy corrupt.*day 2022-06-02.*monim forget --day 2022-06-02".format(folder.name)
    with pytest.raises(Damaged, match=refusal):
        Memory.open(tmp_path, tiny)
    config = {"memory": str(tmp_path), "as_of": "2022-06-02", "checksum": memory.ds.checksum("2022-06-02")}
    with pytest.raises(Damaged, match=refusal):
        MonimModel().load_context(SimpleNamespace(model_config=config))
    assert len(Memory.open(tmp_path, tiny, as_of="2022-06-01")) == 6  # the damaged day is not read as of the day before
    # the way out: the damaged day forgotten (a forget opens the memory without checking the day it removes)
    Memory.open(tmp_path, tiny, removing=("2022-06-02",)).forget(days=["2022-06-02"])
    assert len(Memory.open(tmp_path, tiny)) == 6
    keys = tmp_path / "shards" / memory.ds.days[0].shard / "keys.npy"
    keys.write_bytes(keys.read_bytes()[:-100])  # truncated
    with pytest.raises(Damaged, match="keys.npy corrupt.*day 2022-06-01"):
        Memory.open(tmp_path, tiny)
    with pytest.raises(Damaged, match=f"{keys}: cannot be read .*the shard of day 2022-06-01 is damaged"):
        Datastore.read(tmp_path).shards.shard(memory.ds.days[0].shard, "keys")


def test_a_served_file_written_in_place_stops_every_answer_and_a_damaged_champion_is_not_swapped_in(tiny, tmp_path):
    """A served (pinned) Θ whose values.npy is rewritten in place is found at its next look: every
    request is refused (503, naming the file and the day) and /health and /ping say "damaged"; the
    bytes put back, it answers as before. A new champion whose files differ from their commit is
    not loaded: the served one answers on, and /health says "stale", naming the file and the day."""
    import shutil

    from fastapi.testclient import TestClient

    from monim.serving.service import Busy, Service
    from monim.theta.memory import Memory
    from servers.model import Follower, app_for, health_of

    root = tmp_path / "served"
    memory = two_days(root, tiny)
    values = root / "shards" / memory.ds.days[1].shard / "values.npy"
    good = values.read_bytes()
    body = {"dataframe_records": [{"prompt": "The bank said"}], "params": {"max_new_tokens": 4}}
    service = Service(Memory.open(root, tiny).pin(), about={"version": "1"})
    service.LOOK_S = 0.0  # a look at every request (the server: at most once a second)
    client = TestClient(app_for(service))
    try:
        alone = service.answer(body)
        assert health_of(service, None)["status"] == "ok" and client.get("/ping").status_code == 200
        np.save(values, np.load(values)[::-1].copy())  # in place: the pinned map sees the new bytes
        with pytest.raises(Busy, match=f"{values}: written since it was verified.*day 2022-06-02.*monim forget"):
            service.answer(body)
        health = health_of(service, None)
        assert health["status"] == "damaged" and str(values) in health["problem"]
        ping = client.get("/ping")
        assert ping.status_code == 503 and ping.json()["status"] == "damaged"
        values.write_bytes(good)  # put back in place: read again, answered as before
        assert service.answer(body) == alone and health_of(service, None)["status"] == "ok"
        champion = Path(shutil.copytree(root, tmp_path / "champion"))  # another version, damaged
        copied = champion / values.relative_to(root)
        np.save(copied, np.load(copied)[::-1].copy())
        follower = Follower(service, lambda: {"model": "m", "version": "2", "as_of": "2022-06-02", "memory": str(champion),
                                              "checksum": "c"}, lambda found: Memory.open(found["memory"], tiny).pin(), 60)
        assert follower.check() is False and service.about["version"] == "1" and service.answer(body) == alone
        health = health_of(service, follower)
        assert health["status"] == "stale" and f"{copied.parent}: values.npy corrupt" in health["problem"]
        assert "day 2022-06-02" in health["problem"]
    finally:
        service.close()
