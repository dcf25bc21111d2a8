"""Datastore commits, crashes, forgetting, and the index that follows it."""

import json
import os

import numpy as np
import pytest

from helpers import random_entries
from monim.core.manifest import MemoryMismatch
from monim.storage.datastore import Datastore
from monim.storage.forgotten import ForgottenDay
from monim.storage.index import IndexConfig, MemoryIndex, indexed_ids

D = 8


def snapshot(root):
    """Everything a reader sees: the manifest and every array of every committed day."""
    ds = Datastore(root, {"model": "m", "hidden_size": D, "tokenizer": "tok"})
    return json.dumps(ds.manifest, sort_keys=True), {a: ds.shards.array(a).tolist() for a in ("keys", "values", "ids", "docs", "positions")}


def test_commit_reopen_and_counts(tmp_path):
    ds = Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"})
    e1, e2 = random_entries(10), random_entries(5, seed=1, doc="b")
    assert ds.commits.commit_day("2022-06-01", e1, tokens_seen=20, policy="monim-amt", params={"delta": -1.5})
    assert ds.commits.commit_day("2022-06-02", e2, tokens_seen=25, policy="monim-amt")
    ds = Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"})  # reopen from disk
    np.testing.assert_array_equal(ds.shards.array("keys"), np.concatenate([e1.keys, e2.keys]))
    assert ds.shards.array("values").dtype == np.int32 and ds.shards.array("values")[-1] == e2.values[-1]  # > int16
    assert len(ds) == 15 and ds.tokens_seen == 45 and ds.memrate == pytest.approx(15 / 45)
    assert [d.memrate for d in ds.days] == [0.5, 0.2]
    m = ds.manifest
    assert (m["model"], m["hidden_size"], m["tokenizer"], m["key_dtype"]) == ("m", D, "tok", "float16")
    assert m["days"][0]["params"] == {"delta": -1.5} and m["days"][0]["tokens_seen"] == 20
    assert ds.bytes_on_disk() > 15 * D * 2


def test_recommit_is_a_noop_and_force_replaces_only_the_last_day(tmp_path):
    ds = Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"})
    ds.commits.commit_day("2022-06-01", random_entries(10), 20, "fullmem")
    ds.commits.commit_day("2022-06-02", random_entries(6, 1), 20, "fullmem")
    before = snapshot(tmp_path)
    assert not ds.commits.commit_day("2022-06-02", random_entries(3, 2), 20, "fullmem")
    assert snapshot(tmp_path) == before
    with pytest.raises(ValueError, match="not the last day"):
        ds.commits.commit_day("2022-06-01", random_entries(3, 2), 20, "fullmem", force=True)
    with pytest.raises(ValueError, match="comes before"):
        ds.commits.commit_day("2022-05-31", random_entries(3, 2), 20, "fullmem")
    assert ds.commits.commit_day("2022-06-02", random_entries(3, 2), 20, "fullmem", force=True)
    assert len(ds) == 13 and [d.entries for d in ds.days] == [10, 3]
    assert len(list((tmp_path / "shards").iterdir())) == 2  # the replaced shard is gone


def test_another_model_tokenizer_or_weights_is_refused_naming_the_field(tmp_path):
    ident = {"model": "m", "hidden_size": D, "tokenizer": "tok", "weights": "w1"}
    Datastore(tmp_path, ident).commits.commit_day("2022-06-01", random_entries(4), 4, "fullmem")
    with pytest.raises(MemoryMismatch, match="field 'tokenizer': learned with 'tok', but this LM has 'other'"):
        Datastore(tmp_path, ident | {"tokenizer": "other"})
    with pytest.raises(MemoryMismatch, match="field 'model': learned with 'm'"):
        Datastore(tmp_path, ident | {"model": "gpt2"})
    with pytest.raises(MemoryMismatch, match="field 'weights': learned with 'w1', but this LM has 'w2'"):
        Datastore(tmp_path, ident | {"weights": "w2"})


class Crash(Exception):
    pass


@pytest.mark.parametrize("fail_at", range(12))
def test_a_crash_at_any_step_leaves_the_previous_state(fail_at, tmp_path, monkeypatch):
    """Fail the k-th file-system step (fsync or rename) of a commit; the reader sees the old day."""
    ds = Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"})
    ds.commits.commit_day("2022-06-01", random_entries(10), 20, "fullmem")
    before = snapshot(tmp_path)
    calls = {"n": 0, "published": False}

    def failing(real):
        def step(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == fail_at + 1:
                raise Crash(f"crash at step {fail_at}")
            result = real(*args, **kwargs)
            calls["published"] |= str(args[-1]).endswith("manifest.json")
            return result
        return step

    monkeypatch.setattr(os, "fsync", failing(os.fsync))
    monkeypatch.setattr(os, "replace", failing(os.replace))
    try:
        ds.commits.commit_day("2022-06-02", random_entries(7, 1), 20, "fullmem")
        crashed = False
    except Crash:
        crashed = True
    monkeypatch.undo()
    if calls["published"]:  # the manifest rename is the commit point: the day is there whole
        assert len(Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"})) == 17
    else:
        assert crashed and snapshot(tmp_path) == before
    # the memory stays usable: the day commits (or is already there) and leftovers are cleaned
    ds = Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"})
    ds.commits.commit_day("2022-06-02", random_entries(7, 1), 20, "fullmem")
    assert len(ds) == 17 and len(list((tmp_path / "shards").iterdir())) == 2


def test_forget_documents_and_days_and_the_index_follows(tmp_path):
    ds = Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"})
    e1, e2 = random_entries(12, doc="a"), random_entries(9, 1, doc="b")
    ds.commits.commit_day("2022-06-01", e1, 12, "fullmem")
    ds.commits.commit_day("2022-06-02", e2, 9, "fullmem")
    index = MemoryIndex(tmp_path, D)
    index.sync(ds)
    assert ds.commits.forget(doc_ids=["a1"]) == 4
    index.sync(ds)
    keep = np.array([d != "a1" for d in e1.doc_ids])
    np.testing.assert_array_equal(ds.shards.array("keys")[:8], e1.keys[keep])
    _, ids = index.search(e1.keys[~keep].astype(np.float32), k=21)
    assert not np.isin(ids, np.flatnonzero(~keep)).any() and (ids >= 0).sum(1).max() == 17
    assert ds.commits.forget(days=["2022-06-02"]) == 9  # the last day: uncommitted, as if it had not been learned
    index.sync(ds)
    assert len(ds) == 8 and index.ntotal == 8 and [d.date for d in ds.days] == ["2022-06-01"]
    assert set(ds.shards.values_by_id()[indexed_ids(index.index)]) <= set(e1.values[keep])
    with pytest.raises(ForgottenDay, match="2022-06-02 was forgotten.*--relearn 2022-06-02"):
        ds.commits.commit_day("2022-06-02", e2, 9, "fullmem")  # forgotten for good: not learned again ...
    ds.commits.relearn("2022-06-02")
    assert ds.commits.commit_day("2022-06-02", e2, 9, "fullmem")  # ... unless asked by name
    assert ds.commits.forget(days=["2022-06-01"]) == 8  # an earlier day: its entries go, the day stays committed
    assert (ds.days[0].entries, ds.days[0].forgotten, len(ds)) == (0, 12, 9)


def test_a_forget_repeated_leaves_no_stray_and_a_pinned_reader_keeps_its_state(tmp_path):
    """A document forgotten twice writes no second shard version (the first forget left nothing of it in
    the shard); a reader pinned before a forget reads the arrays it
    opened, whose files the forget removed, and an unpinned one of the old state cannot."""
    ident = {"model": "m", "hidden_size": D, "tokenizer": "tok"}
    ds = Datastore(tmp_path, ident)
    e1 = random_entries(12, doc="a")
    ds.commits.commit_day("2022-06-01", e1, 12, "fullmem")
    ds.commits.commit_day("2022-06-02", random_entries(9, 1, doc="b"), 9, "fullmem")
    pinned, stale = Datastore.read(tmp_path), Datastore.read(tmp_path)
    pinned.shards.pin()
    old_shard = ds.days[0].shard
    assert Datastore(tmp_path, ident).commits.forget(doc_ids=["a1"]) == 4
    assert Datastore(tmp_path, ident).commits.forget(doc_ids=["a1"]) == 0
    named = {d.shard for d in Datastore.read(tmp_path).days}
    assert {p.name for p in (tmp_path / "shards").iterdir()} == named and old_shard not in named
    np.testing.assert_array_equal(pinned.shards.shard(old_shard, "keys"), e1.keys)  # its files are gone from the directory
    assert pinned.shards.shard_docs(old_shard) == ["a0", "a1", "a2"] and pinned.shards.has_array(old_shard, "ids")
    np.testing.assert_array_equal(pinned.shards.values_by_id()[:12], e1.values)
    with pytest.raises(FileNotFoundError):
        stale.shards.values_by_id()


def test_stale_or_missing_index_is_detected_and_rebuilt(tmp_path):
    cfg = IndexConfig(exact_below=300, code_bytes=4, nprobe=8)  # IVF-PQ: kept on disk
    ds = Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"})
    ds.commits.commit_day("2022-06-01", random_entries(300), 300, "fullmem")
    MemoryIndex(tmp_path, D, cfg).sync(ds)
    ds.commits.commit_day("2022-06-02", random_entries(50, 1), 50, "fullmem")  # committed, index not updated (a crash)
    index = MemoryIndex(tmp_path, D, cfg)
    assert index.ntotal == 300 and index.sync(ds)["added"] == 50 and index.ntotal == 350
    (tmp_path / "index" / "index.faiss").unlink()
    index = MemoryIndex(tmp_path, D, cfg)
    stats = index.sync(ds)
    assert stats["rebuilt"] and index.ntotal == 350
    (tmp_path / "index" / "index.faiss").write_bytes(b"garbage")
    index = MemoryIndex(tmp_path, D, cfg)
    assert index.sync(ds)["rebuilt"] and index.ntotal == 350
    assert MemoryIndex(tmp_path, D, cfg).sync(ds)["seconds"] == 0.0  # up to date: nothing to do


def test_an_exact_index_is_built_in_ram_from_the_shards_and_never_written(tmp_path):
    """Below `exact_below` the index is the shards' keys in RAM (fp32): on disk it would hold every key
    twice. An exact index an older monim wrote is removed at the next save."""
    ds = Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"})
    ds.commits.commit_day("2022-06-01", random_entries(10), 10, "fullmem")
    index = MemoryIndex(tmp_path, D)
    assert index.sync(ds)["rebuilt"] and index.meta["kind"] == "flat" and index.ntotal == 10
    assert index.bytes_on_disk() == 0 and not (tmp_path / "index" / "index.faiss").exists()
    reopened = MemoryIndex(tmp_path, D)
    assert reopened.ntotal == 0 and reopened.sync(ds)["added"] == 10
    _, ids = reopened.search(ds.shards.array("keys")[:3].astype(np.float32), 1)
    np.testing.assert_array_equal(ids[:, 0], [0, 1, 2])  # each key finds itself
    import faiss  # an exact index as monim 0.1 saved it

    (tmp_path / "index").mkdir(exist_ok=True)
    faiss.write_index(index.index, str(tmp_path / "index" / "index.faiss"))
    (tmp_path / "index" / "meta.json").write_text('{"kind": "flat", "version": 1, "ntotal": 10}')
    old = MemoryIndex(tmp_path, D)
    assert old.obsolete and old.index is None
    old.sync(ds)
    assert not (tmp_path / "index" / "index.faiss").exists() and old.ntotal == 10


def test_ivfpq_for_large_memories_grows_incrementally_and_retrains(tmp_path):
    cfg = IndexConfig(exact_below=2000, codec="pq", code_bytes=4, nprobe=8, retrain_growth=2.0, max_nlist=16)
    ds = Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"})
    ds.commits.commit_day("2022-06-01", random_entries(1500), 1500, "fullmem")
    index = MemoryIndex(tmp_path, D, cfg)
    assert index.sync(ds)["rebuilt"] and index.meta["kind"] == "flat"
    ds.commits.commit_day("2022-06-02", random_entries(1500, 1), 1500, "fullmem")
    assert index.sync(ds)["rebuilt"] and index.meta["kind"] == "ivfpq" and index.meta["trained_on"] == 3000
    ds.commits.commit_day("2022-06-03", random_entries(1000, 2), 1000, "fullmem")
    stats = index.sync(ds)
    assert not stats["rebuilt"] and stats["added"] == 1000 and index.ntotal == 4000
    ds.commits.commit_day("2022-06-04", random_entries(2000, 3), 2000, "fullmem")  # 6000 >= 2 x 3000: retrain
    assert index.sync(ds)["rebuilt"] and index.meta["trained_on"] == 6000
    keys = ds.shards.array("keys").astype(np.float32)
    _, ids = index.search(keys[:200], k=10)
    recall = np.mean([i in row for i, row in zip(ds.shards.array("ids")[:200], ids)])
    assert recall > 0.8, recall
