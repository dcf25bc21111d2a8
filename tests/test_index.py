"""The FAISS index: both IVF codecs against brute force, the GPU settings, the recall probe, mapped lists."""

import json

import faiss
import numpy as np
import pytest

from monim.core.config import CalibratorConfig
from monim.storage.datastore import Datastore
from monim.storage.entries import Entries
from monim.storage.fsck import check_memory
from monim.storage.index import IndexConfig, MemoryIndex, gpu_options, gpu_precomputed, index_kind, new_ivf

D = 16


def commit(ds: Datastore, day: int, keys: np.ndarray, searched: int = 0) -> None:
    n = len(keys)
    ds.commits.commit_day(f"2022-06-{day:02d}", Entries(keys.astype(np.float16), np.arange(n, dtype=np.int32) % 97,
                                                 [f"d{day}"] * n, np.arange(n)), n, "fullmem", searched=searched)


def small_cfg(**kw) -> IndexConfig:
    """Small lists; 8-byte codes either way (16 dims in 8 of 8 bits, or in 16 of 4 bits)."""
    return IndexConfig(**{"exact_below": 2000, "code_bytes": 8, "fastscan_dims": 1, "nprobe": 16, "max_nlist": 16} | kw)


@pytest.mark.parametrize("codec", ["fastscan", "pq"])
def test_ivf_codecs_find_the_brute_force_neighbours_within_time_and_exclusions(tmp_path, codec):
    rng = np.random.default_rng(0)
    ds = Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"})
    commit(ds, 1, rng.standard_normal((3000, D)))
    commit(ds, 2, rng.standard_normal((1000, D)))
    index = MemoryIndex(tmp_path, D, small_cfg(codec=codec))
    index.sync(ds)
    assert index.meta["kind"] == "ivfpq" and index.meta["codec"] == codec and index.ntotal == 4000
    keys = ds.shards.array("keys").astype(np.float32)
    queries = rng.standard_normal((100, D)).astype(np.float32)
    banned = np.arange(0, 3000, 7)
    allowed = np.setdiff1d(np.arange(3000), banned)  # time travel to day 1, every 7th entry left out
    nearest = allowed[((queries[:, None] - keys[allowed][None]) ** 2).sum(-1).argmin(1)]
    _, ids = index.search(queries, k=20, below=3000, exclude=banned)
    assert (ids < 3000).all() and not np.isin(ids, banned).any()
    assert np.mean([n in row for n, row in zip(nearest, ids)]) >= 0.9
    nearest_all = ((queries[:, None] - keys[None]) ** 2).sum(-1).argmin(1)
    _, ids = index.search(queries, k=20)
    assert np.mean([n in row for n, row in zip(nearest_all, ids)]) >= 0.9


def test_a_memory_whose_decision_searches_turns_ivf_pq_sooner_and_fsck_expects_it(tmp_path):
    """An exact day costs entries x queries: a memory whose last day's decision searched as many
    training tokens as the calibration sample has (twice the queries) turns IVF-PQ at half of
    `exact_below`; one that searches nothing, and a day recorded before `searched` was, at all of it."""
    sample = CalibratorConfig().sample_tokens
    rng = np.random.default_rng(5)
    settings = {"index": {"exact_below": 2000, "code_bytes": 8, "nprobe": 16, "max_nlist": 16}}
    kinds = {}
    for name, n, searched in [("fullmem", 1500, 0), ("monim", 1500, sample), ("small", 900, sample),
                              ("thrice", 600, 3 * sample)]:
        ds = Datastore(tmp_path / name, {"model": "m", "hidden_size": D, "tokenizer": "tok"})
        commit(ds, 1, rng.standard_normal((n, D)), searched)
        manifest = json.loads((ds.root / "manifest.json").read_text())
        (ds.root / "manifest.json").write_text(json.dumps(manifest | {"settings": settings}))
        ds = Datastore.read(ds.root)
        index = MemoryIndex(ds.root, D, small_cfg())
        index.sync(ds)
        kinds[name] = index.meta["kind"]
        assert check_memory(ds.root) == []
        if kinds[name] == "ivfpq":  # fsck knows the memory calls for an IVF-PQ index on disk
            (index.dir / "index.faiss").unlink()
            assert [p.what.split(" (")[0] for p in check_memory(ds.root)] == ["IVF-PQ index missing"]
    # limits by hand: 2000; 2000 x 1/2 = 1000; 1000; 2000 x 1/4 = 500
    assert kinds == {"fullmem": "flat", "monim": "ivfpq", "small": "flat", "thrice": "ivfpq"}
    old = json.loads((tmp_path / "monim" / "manifest.json").read_text())
    del old["days"][0]["searched"]  # a day committed before the field: the entries alone decide
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "manifest.json").write_text(json.dumps(old))
    assert index_kind(MemoryIndex(tmp_path / "old", D, small_cfg()).cfg, Datastore.read(tmp_path / "old")) == "flat"


def test_codec_choice_and_gpu_settings():
    assert IndexConfig().codec == "pq"  # the paper's: fast-scan's distances are too coarse for the kNN softmax
    with pytest.raises(ValueError, match="codec"):
        IndexConfig(codec="hnsw")
    with pytest.raises(ValueError, match="divisible"):
        new_ivf(578, 4, IndexConfig(codec="fastscan"))  # no 4-dim sub-vectors
    # FAISS's GPU kernels take 1, 2, 3, 4, 6, 8, ... dims per sub-vector: the paper's 64 bytes over
    # 576 dims (9 each) need precomputed tables, 48 bytes (12 each) do not
    assert gpu_precomputed(new_ivf(576, 4, IndexConfig(code_bytes=64)), 576)
    assert not gpu_precomputed(new_ivf(576, 4, IndexConfig(code_bytes=48)), 576)
    assert not gpu_precomputed(new_ivf(576, 4, IndexConfig(codec="fastscan")), 576)


def test_gpu_clone_options_set_real_fields():
    """SWIG takes any attribute name silently: a misspelt option would leave fp16 tables off and the
    clone of 64-byte codes failing (to the CPU); these are the fields the cloner reads."""
    if not hasattr(faiss, "GpuClonerOptions"):
        pytest.skip("a FAISS build without GPU support")
    options = gpu_options(new_ivf(576, 4, IndexConfig()), 576)
    assert options.useFloat16 and options.usePrecomputed
    assert not gpu_options(new_ivf(576, 4, IndexConfig(code_bytes=48)), 576).usePrecomputed


def test_an_index_of_another_codec_is_rebuilt_at_the_next_change(tmp_path):
    rng = np.random.default_rng(3)
    ds = Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"})
    commit(ds, 1, rng.standard_normal((3000, D)))
    MemoryIndex(tmp_path, D, small_cfg(codec="pq")).sync(ds)  # built on a GPU machine, say
    index = MemoryIndex(tmp_path, D, small_cfg(codec="fastscan"))
    assert index.meta["codec"] == "pq" and index.sync(ds)["seconds"] == 0.0  # current: searched as it is
    commit(ds, 2, rng.standard_normal((500, D)))
    assert index.sync(ds)["rebuilt"] and index.meta["codec"] == "fastscan" and index.ntotal == 3500


def test_probe_recall_falls_on_drifted_keys_and_retrains(tmp_path):
    rng = np.random.default_rng(1)
    ds = Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"})
    scale = np.r_[np.ones(8), np.full(8, 0.01)]  # day 1 lives in the first 8 dims: PQ learns nothing of the rest
    commit(ds, 1, rng.standard_normal((3000, D)) * scale)
    cfg = small_cfg(codec="pq", probe=40, probe_pool=2000, retrain_growth=100.0, k=10)
    index = MemoryIndex(tmp_path, D, cfg)
    index.sync(ds)
    assert index.meta["recall_at_train"] >= 0.8
    commit(ds, 2, rng.standard_normal((400, D)) * scale)  # more of the same: no retraining
    stats = index.sync(ds)
    assert not stats["rebuilt"] and stats["recall"] >= 0.9 * index.meta["recall_at_train"]
    commit(ds, 3, rng.standard_normal((600, D)) * scale[::-1] * 3)  # a new region: its codes collide
    stats = index.sync(ds)
    assert stats["recall"] < 0.6 and stats["rebuilt"] and index.meta["trained_on"] == 4000
    assert index.meta["recall_at_train"] >= 0.8


def test_a_large_pq_index_is_mapped_for_readers_and_read_into_ram_to_change(tmp_path):
    rng = np.random.default_rng(2)
    ds = Datastore(tmp_path, {"model": "m", "hidden_size": D, "tokenizer": "tok"})
    commit(ds, 1, rng.standard_normal((3000, D)))
    MemoryIndex(tmp_path, D, small_cfg(codec="pq")).sync(ds)
    queries = rng.standard_normal((20, D)).astype(np.float32)
    in_ram = MemoryIndex(tmp_path, D, small_cfg(codec="pq"))
    mapped = MemoryIndex(tmp_path, D, small_cfg(codec="pq", map_above=0.0))
    assert not in_ram.mapped and mapped.mapped
    np.testing.assert_array_equal(mapped.search(queries, k=10)[1], in_ram.search(queries, k=10)[1])
    commit(ds, 2, rng.standard_normal((500, D)))
    assert mapped.sync(ds)["added"] == 500 and not mapped.mapped and mapped.ntotal == 3500
