"""A memory's searches spread over workers (monim.theta.spread) and its index split by day range into parts
(monim.storage.parts): the same answers as one process and one index, parts synced alone, nothing forgotten kept."""

import dataclasses
import datetime as dt
import hashlib
import multiprocessing
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import faiss
import numpy as np
import pytest

from helpers import fingerprint, nearest_by_numpy
from monim.core.config import DEMO_STREAM, IndexConfig
from monim.core.lock import hold
from monim.core.recency import Recency
from monim.core.workers import InProcess
from monim.storage.datastore import Datastore
from monim.storage.entries import Entries
from monim.storage.fsck import check_memory
from monim.storage.index import MemoryIndex, indexed_ids
from monim.storage.parts import Parts, merge
from monim.theta.searcher import Searcher
from monim.theta.spread import Spread, chunks

D = 16


class Pool:
    """Workers that are other processes (spawned: every request and answer pickled, the memory opened there)."""

    size = 2

    def __init__(self, pool: ProcessPoolExecutor):
        self.pool, self.calls = pool, 0

    def map(self, fn, items):
        self.calls += 1
        return list(self.pool.map(fn, items))


@pytest.fixture(scope="module")
def pool():
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as executor:
        yield Pool(executor)


def commit(ds: Datastore, date: str, keys: np.ndarray, doc: str) -> None:
    n = len(keys)
    ds.commits.commit_day(date, Entries(keys.astype(np.float16), np.arange(n, dtype=np.int32) % 97,
                                        [f"{doc}{i % 3}" for i in range(n)], np.arange(n)), n, "fullmem")


def random_memory(root: Path, sizes: tuple[int, ...], seed: int = 0) -> Datastore:
    """A memory of random 16-dim keys around 8 centres (clustered, as an LM's are), one day per size (2022-06-01 on)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((8, D)) * 3
    ds = Datastore(root, {"model": "random", "hidden_size": D, "tokenizer": "vocab"})
    for i, n in enumerate(sizes):
        commit(ds, f"2022-06-{i + 1:02d}", centres[rng.integers(0, 8, n)] + rng.standard_normal((n, D)), f"day{i}-")
    return ds


def searcher(ds: Datastore, cfg: IndexConfig, as_of: str | None = None, recency: Recency = Recency()) -> Searcher:
    return Searcher(ds, MemoryIndex(ds.root, D, cfg), as_of, recency, Parts(ds.root, D, cfg))


def files(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under `root`: its modification time and content hash."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_memory_in_parts_answers_as_one_index_and_brute_force_here_and_on_workers(tmp_path, pool):
    """Exact parts (one a day) merged give the nearest entries brute force gives, within every limit
    a search has (below, exclude, as_of, recency); on workers (other processes, the queries split)
    the answers equal this process's bit for bit; the workers write nothing and take no lock."""
    ds = random_memory(tmp_path / "parts", (300, 0, 250, 400))
    shutil.copytree(tmp_path / "parts", tmp_path / "one")
    one_ds = Datastore.read(tmp_path / "one")
    cfg = IndexConfig(k=24, query_batch=16)  # chunks of 16 queries: 60 queries spread over 4 requests
    queries = np.random.default_rng(7).standard_normal((60, D)).astype(np.float32) * 3
    keys, ids = ds.shards.array("keys").astype(np.float32), ds.shards.array("ids")
    exclude = ids[::5]
    for as_of, recency, below in [(None, Recency(), None), (None, Recency(), 500), ("2022-06-03", Recency(), None),
                                  (None, Recency(max_age=1), None), ("2022-06-03", Recency(max_age=0), 600)]:
        split, whole = searcher(ds, dataclasses.replace(cfg, part_bytes=1), as_of, recency), searcher(one_ds, cfg, as_of, recency)
        found = split.nearest(queries, below=below, exclude=exclude)
        assert split.split and not whole.split and split.parts.plan(ds) == ["2022-06-01", "2022-06-03", "2022-06-04"]
        lo, hi = split.limits(None, below)["above"], split.limits(None, below)["below"] or len(ids)
        allowed = (ids >= lo) & (ids < hi) & ~np.isin(ids, exclude)
        ref_d, ref_i = nearest_by_numpy(queries, keys, 24, allowed)
        np.testing.assert_array_equal(found[1][:, :16], ids[ref_i][:, :16])  # the exact head: ids equal
        np.testing.assert_allclose(found[0], ref_d, rtol=1e-4, atol=1e-4)
        assert np.mean(found[1] == ids[ref_i]) > 0.99  # beyond the head, FAISS's distances' last bits may swap a pair
        one = whole.nearest(queries, below=below, exclude=exclude)
        np.testing.assert_array_equal(one[1][:, :16], found[1][:, :16])
        np.testing.assert_allclose(one[0], found[0], rtol=1e-4, atol=1e-4)
        with hold(ds.lock):  # the writer holds the lock: a worker that took it would fail
            before = files(tmp_path)
            for workers in (InProcess(), pool):
                spread = Spread(workers).nearest(split, queries, below=below, exclude=exclude)
                np.testing.assert_array_equal(spread[1], found[1])
                np.testing.assert_array_equal(spread[0], found[0])
                spread = Spread(workers).nearest(whole, queries, below=below, exclude=exclude)
                np.testing.assert_array_equal(spread[1], one[1])
                np.testing.assert_array_equal(spread[0], one[0])
            assert files(tmp_path) == before


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([np.isin(t, f).mean() for t, f in zip(truth, found)]))


def test_ivf_pq_parts_recall_against_one_index_and_brute_force_and_a_narrow_window_is_exact(tmp_path, pool):
    """IVF-PQ parts (one a day), merged: recall@10 against brute force and against one IVF-PQ index of
    the same entries; a recency window narrower than `exact_below` is searched exactly in every part."""
    ds = random_memory(tmp_path / "parts", (3000, 3000, 3000, 1000), seed=1)
    shutil.copytree(tmp_path / "parts", tmp_path / "one")
    cfg = IndexConfig(k=64, exact_below=2000, code_bytes=8, nprobe=8, max_nlist=32, probe=0, part_bytes=1)
    split, whole = searcher(ds, cfg), searcher(Datastore.read(tmp_path / "one"), dataclasses.replace(cfg, part_bytes=None))
    split.sync(), whole.sync()
    kinds = [split.parts.index(n).meta["kind"] for n in split.parts.plan(ds)]
    assert kinds == ["ivfpq", "ivfpq", "ivfpq", "flat"] and whole.index.meta["kind"] == "ivfpq"
    assert not (tmp_path / "parts" / "index").exists()  # split: no index of the whole memory
    keys, ids = ds.shards.array("keys").astype(np.float32), ds.shards.array("ids")
    queries = keys[np.random.default_rng(2).choice(len(keys), 200, replace=False)] + 0.3 * np.random.default_rng(
        3).standard_normal((200, D)).astype(np.float32)
    truth = ids[nearest_by_numpy(queries, keys, 10)[1]]
    measured = {}
    for exact in (False, True):
        parts, one = split.nearest(queries, exact=exact)[1], whole.nearest(queries, exact=exact)[1]
        measured[exact] = (recall(parts[:, :10], truth), recall(one[:, :10], truth), recall(parts[:, :10], one[:, :10]))
        np.testing.assert_array_equal(Spread(pool).nearest(split, queries, exact=exact)[1], parts)
    print("recall@10 (parts vs brute force, one index vs brute force, parts vs one index), approximate / exact:", measured)
    assert all(r >= 0.8 for rs in measured.values() for r in rs)
    assert measured[True][0] >= measured[True][1] - 0.05  # parts probe as many lists each: no worse than one index
    narrow = searcher(ds, cfg, recency=Recency(max_age=0))  # the last day alone: 1,000 < exact_below
    assert narrow.limits()["recent"] == ["2022-06-04"]
    last = ids >= 9000
    for found in (narrow.nearest(queries, 10), Spread(pool).nearest(narrow, queries, 10)):
        np.testing.assert_array_equal(found[1], ids[nearest_by_numpy(queries, keys, 10, last)[1]])


def test_a_day_a_forget_and_a_relearn_touch_only_their_parts_and_nothing_forgotten_stays(tmp_path):
    """Each change re-syncs only the parts of the days it changes (the others' files untouched); a
    forgotten article is in no part's index file; fsck knows the parts' files."""
    ds = random_memory(tmp_path, (3000,), seed=4)
    cfg = IndexConfig(exact_below=2000, code_bytes=8, nprobe=8, max_nlist=32, probe=0, part_bytes=1)
    s = searcher(ds, cfg)
    s.sync()
    assert not s.split and (tmp_path / "index" / "index.faiss").exists()  # one day: one index
    commit(ds, "2022-06-02", np.random.default_rng(5).standard_normal((3000, D)) * 3, "day1-")
    s.sync()
    assert not (tmp_path / "index").exists()  # split: the whole memory's index goes
    parts = tmp_path / "parts"
    assert s.split and sorted(p.name for p in parts.iterdir()) == ["2022-06-01", "2022-06-02", "plan.json"]
    first = files(parts / "2022-06-01")
    second = files(parts / "2022-06-02")
    commit(ds, "2022-06-03", np.random.default_rng(5).standard_normal((2500, D)), "day2-")
    assert s.sync()["added"] == 2500
    assert files(parts / "2022-06-01") == first and files(parts / "2022-06-02") == second
    assert (parts / "2022-06-03" / "index" / "index.faiss").exists()
    assert check_memory(tmp_path) == []
    third = files(parts / "2022-06-03")
    docs = ds.shards.shard_docs(ds.days[1].shard)
    rows = np.asarray(ds.shards.shard(ds.days[1].shard, "docs"))
    forgotten = np.asarray(ds.shards.shard(ds.days[1].shard, "ids"))[np.array(docs)[rows] == "day1-1"]
    their_keys = ds.shards.keys_of(forgotten)
    assert len(forgotten) == 1000 and ds.commits.forget(doc_ids=["day1-1"]) == 1000
    assert s.sync()["removed"] == 1000
    assert files(parts / "2022-06-01") == first and files(parts / "2022-06-03") == third
    assert files(parts / "2022-06-02") != second
    for index_file in parts.glob("*/index/index.faiss"):
        held = indexed_ids(faiss.read_index(str(index_file)))
        assert not np.isin(forgotten, held).any()
    assert not np.isin(forgotten, s.nearest(their_keys, 64)[1]).any()
    assert check_memory(tmp_path) == []
    second = files(parts / "2022-06-02")
    ds.commits.forget(days=["2022-06-03"])  # the last day: uncommitted, to be learned again by name
    ds.commits.relearn("2022-06-03")
    commit(ds, "2022-06-03", np.random.default_rng(6).standard_normal((2500, D)), "day2-")
    s.sync()
    assert files(parts / "2022-06-01") == first and files(parts / "2022-06-02") == second
    assert files(parts / "2022-06-03") != third and check_memory(tmp_path) == []
    damaged = parts / "2022-06-02" / "index" / "index.faiss"
    damaged.write_bytes(b"garbage")
    assert [p.where for p in check_memory(tmp_path)] == [str(damaged.parent)]
    assert check_memory(tmp_path, repair=True)[0].repaired and check_memory(tmp_path) == []
    assert files(parts / "2022-06-01") == first  # the part alone rebuilt
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "index.faiss").write_bytes(b"left over")
    assert [p.where for p in check_memory(tmp_path)] == [str(tmp_path / "index")]


@pytest.fixture(scope="module")
def days():
    from monim.data.feed import open_feed
    from monim.data.stream import iter_days

    return [day.capped(3) for day in iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 2), dt.date(1987, 3, 3))]


@pytest.mark.parametrize("part_bytes", [None, 1])
@pytest.mark.parametrize("policy", ["fullmem", "monim-amt"])
def test_days_learned_through_spread_searches_give_the_same_memory_and_ppl(tiny, days, pool, tmp_path, policy,
                                                                           part_bytes):
    """The same days learned (memorized, calibrated, evaluated) with every search on workers give the
    memory (entries, ids, every file's checksum: `fingerprint`; Memory.checksum names the shards' random
    folders) and the PPL the same days give in one process."""
    from monim.evaluation.evaluate import evaluate
    from monim.learning.calibration import calibrate
    from monim.learning.memorize import memorize_day
    from monim.learning.policies import make_policy
    from monim.storage.memory_settings import Settings
    from monim.theta.memory import Memory

    results, asked = {}, pool.calls
    for where, workers in (("here", None), ("workers", pool)):
        memory = Memory(tmp_path / where, tiny, Settings(index=IndexConfig(k=16, part_bytes=part_bytes)))
        memory.spread_over(workers)
        for day in days:
            memorize_day(memory, day, make_policy(policy))
            calibrate(memory, day)
        test = [d for day in days for d in day.test]
        assert memory.at(days[0].date)._spread.workers is workers  # a view searches where its memory does
        results[where] = (fingerprint(tmp_path / where), len(memory), memory.ds.shards.array("ids"),
                          evaluate(tiny, test, memory.at(days[-1].date))["ppl"])
        assert memory._searcher.split == (part_bytes is not None)
        assert not memory.parts._indexes or workers is None  # on workers, this process holds no part
    assert pool.calls > asked  # the searches of every stage went to the workers
    here, there = results["here"], results["workers"]
    assert here[0] == there[0] and here[1] == there[1]
    np.testing.assert_array_equal(here[2], there[2])
    assert here[3] == pytest.approx(there[3], rel=1e-6)


def test_on_workers_the_writer_saves_each_part_it_changes_and_holds_none(tmp_path, pool):
    """A memory searched on workers: its process saves the IVF-PQ parts a change touches and lets them
    go, builds no exact part, and the workers' answers equal those of the same memory searched here."""
    random_memory(tmp_path / "here", (3000, 3000, 1000), seed=8)
    shutil.copytree(tmp_path / "here", tmp_path / "there")
    cfg = IndexConfig(k=32, exact_below=2000, code_bytes=8, nprobe=8, max_nlist=32, probe=0, part_bytes=1)
    here, there = searcher(Datastore.read(tmp_path / "here"), cfg), searcher(Datastore.read(tmp_path / "there"), cfg)
    there.parts.searched_here(False)
    queries = np.random.default_rng(9).standard_normal((40, D)).astype(np.float32) * 3
    for change in (None, "day", "forget"):
        if change == "day":
            for s in (here, there):
                commit(s.ds, "2022-06-04", np.random.default_rng(10).standard_normal((2500, D)) * 3, "day3-")
        if change == "forget":
            assert here.ds.commits.forget(doc_ids=["day0-1"]) == there.ds.commits.forget(doc_ids=["day0-1"]) == 1000
        for exact in (False, True):
            a, b = here.nearest(queries, exact=exact), Spread(pool).nearest(there, queries, exact=exact)
            np.testing.assert_array_equal(a[1], b[1])
            np.testing.assert_array_equal(a[0], b[0])
        assert there.parts._indexes == {} and there.split
        saved = sorted(str(p.relative_to(tmp_path / "there")) for p in (tmp_path / "there").glob("parts/*/index/index.faiss"))
        assert saved == [f"parts/{d}/index/index.faiss" for d in ("2022-06-01", "2022-06-02", "2022-06-04")[: 2 + (change is not None)]]
        assert check_memory(tmp_path / "there") == []


def test_parts_answers_merge_by_distance_then_id_and_queries_split_on_whole_batches():
    """Hand-computed: the merged top-k by (distance, id), none (-1) last; chunks of whole query batches."""
    a = (np.array([[1.0, 3.0, np.inf]], np.float32), np.array([[7, 2, -1]]))
    b = (np.array([[1.0, 2.0, 3.0]], np.float32), np.array([[4, 9, 1]]))
    dist, ids = merge([a, b], 4)
    assert ids.tolist() == [[4, 7, 9, 1]] and dist.tolist() == [[1.0, 1.0, 2.0, 3.0]]
    assert merge([a, (np.full((1, 3), np.inf, np.float32), np.full((1, 3), -1))], 4)[1].tolist() == [[7, 2, -1, -1]]
    assert merge([a], 3) is a  # one part: its answer as it is
    assert chunks(10000, 2, 4096) == [(0, 8192), (8192, 10000)] and chunks(100, 4, 4096) == [(0, 100)]
    assert chunks(60, 2, 16) == [(0, 32), (32, 60)] and chunks(0, 2, 16) == []


def test_part_bytes_is_a_setting_the_memory_records_and_checks():
    """--part-bytes reaches the index settings a memory records; another value is refused, naming it; below 1 is refused."""
    from pydantic import ValidationError

    from monim.core.run_config import RunConfig
    from monim.storage.memory_settings import Settings, SettingsMismatch, refuse_other

    settings = Settings.of(RunConfig(part_bytes=1000))
    assert settings.index.part_bytes == 1000 and Settings.from_dict(settings.as_dict()) == settings
    with pytest.raises(SettingsMismatch, match="'index.part_bytes': learned with 1000, not None"):
        refuse_other({"model": "m", "settings": settings.as_dict()}, "m", Settings())
    with pytest.raises(SettingsMismatch, match="index.part_bytes"):
        settings.read_with(part_bytes=5)
    with pytest.raises(ValidationError, match="part_bytes"):
        RunConfig(part_bytes=0)
    with pytest.raises(ValueError, match="part_bytes must be at least 1"):
        IndexConfig(part_bytes=0)


def test_a_worker_lets_go_of_the_parts_a_change_touched(tmp_path):
    """A worker's open parts of a memory: a part opened again after a forget lets go of every other part
    the forget changed, and keeps those it did not."""
    from monim.theta import spread

    ds = random_memory(tmp_path, (300, 300, 300))
    cfg = IndexConfig(k=8, part_bytes=1)
    s = searcher(ds, cfg)
    s.sync()
    root, keys = str(tmp_path), np.zeros((1, D), np.float32)
    for name, version in s.parts.versions(ds).items():
        spread.search_part(spread.SearchPart(root, version, name, keys, 8, None, 0, None, False, None, cfg))
    assert sorted(p for r, p in spread._opened if r == root) == ["2022-06-01", "2022-06-02", "2022-06-03"]
    ds.commits.forget(doc_ids=["day0-1", "day1-1"])
    s.sync()
    new = s.parts.versions(ds)["2022-06-02"]
    spread.search_part(spread.SearchPart(root, new, "2022-06-02", keys, 8, None, 0, None, False, None, cfg))
    assert sorted(p for r, p in spread._opened if r == root) == ["2022-06-02", "2022-06-03"]
    with pytest.raises(spread.StaleSearch, match="changed since the search was asked"):
        spread.search_part(spread.SearchPart(root, "0", "2022-06-03", keys, 8, None, 0, None, False, None, cfg))
