"""Exact search in torch (the GPU path without FAISS's GPU build) against brute force, and the
choice of where a memory is searched."""

import faiss
import numpy as np
import pytest
import torch

from monim.storage.index import IndexConfig, backend
from monim.storage.torch_search import TorchExact, search_backend

GB = 1 << 30


def test_torch_exact_finds_what_brute_force_finds():
    rng = np.random.default_rng(0)
    keys = (rng.normal(size=(5000, 64)) * 30).astype(np.float32)
    queries = (rng.normal(size=(300, 64)) * 30).astype(np.float32)
    ids = np.arange(5000) + 100
    parts = [(keys[:3000], ids[:3000]), (keys[3000:], ids[3000:])]  # uploaded in parts, searched in chunks
    index = TorchExact.from_parts(parts, 5000, 64, "cpu")
    index.chunk = 1000
    dist, found = index.search(queries, 50, block=64)
    want_d, want_i = faiss.knn(queries, keys, 50)
    assert (found == want_i + 100).all()
    np.testing.assert_allclose(dist, want_d, rtol=1e-5)
    few = TorchExact.from_parts([(keys[:20], ids[:20])], 20, 64, "cpu").search(queries[:3], 30)
    assert (few[1][:, 20:] == -1).all() and np.isinf(few[0][:, 20:]).all() and (few[1][:, :20] >= 100).all()


def test_fp16_keys_far_beyond_fp16s_range_keep_their_order():
    # keys of norm ~8000: unscaled, q.k (~6e7) overflows fp16; scaled to |k| <= 1 it does not
    rng = np.random.default_rng(1)
    keys = (rng.normal(size=(2000, 64)) * 1000).astype(np.float16)
    queries = keys[:50].astype(np.float32) + rng.normal(size=(50, 64)).astype(np.float32) * 100
    index = TorchExact(torch.from_numpy(keys.copy()), torch.arange(2000))
    dist, found = index.search(queries, 20)
    want_d, want_i = faiss.knn(queries, keys.astype(np.float32), 20)
    assert (found[:, 0] == np.arange(50)).all() and np.mean([np.isin(a, b).mean() for a, b in zip(found, want_i)]) > 0.95
    np.testing.assert_allclose(dist[:, 0], want_d[:, 0], rtol=1e-3)  # recomputed from the fp16 keys in fp32


@pytest.mark.parametrize("n, faiss_gpus, cuda, free, want", [
    (10_000_000, 1, True, 80 * GB, "faiss-gpu"),  # FAISS's GPU build present: its index
    (10_000_000, 0, True, 80 * GB, "torch"),  # 10M x 576 fp16 = 11.5 GB: fits in half of 80 GB
    (50_000_000, 0, True, 80 * GB, "faiss-cpu"),  # 57.6 GB: does not
    (10_000_000, 0, True, 20 * GB, "faiss-cpu"),  # a GPU mostly taken by others
    (10_000_000, 0, False, 0, "faiss-cpu"),  # no GPU
])
def test_where_a_memory_is_searched(n, faiss_gpus, cuda, free, want):
    assert search_backend(n, 576, faiss_gpus, cuda, free) == want


def test_this_machine_and_an_explicit_cpu_search_on_faiss():
    assert backend(IndexConfig(gpu=False), 10_000_000, 576) == "faiss-cpu"
    if not torch.cuda.is_available() and faiss.get_num_gpus() == 0:
        assert backend(IndexConfig(), 1_000, 576) == "faiss-cpu"


def brute_best(keys: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """The k smallest squared distances of each query, ascending, from all of them in float64."""
    d = ((queries[:, None, :].astype(np.float64) - keys[None, :, :].astype(np.float64)) ** 2).sum(-1)
    return np.sort(d, axis=1)[:, :k]


def assert_exact(keys: np.ndarray, queries: np.ndarray, k: int, chunk: int, block: int = 256):
    """TorchExact's ids are k distinct keys whose float64 distances are the k best (ties may swap ids)."""
    index = TorchExact(torch.from_numpy(keys.copy()), torch.arange(len(keys)) + 7, chunk=chunk)
    dist, found = index.search(queries, k, block=block)
    kk = min(k, len(keys))
    assert (found[:, kk:] == -1).all() and np.isinf(dist[:, kk:]).all()
    found = found[:, :kk] - 7
    assert ((found >= 0) & (found < len(keys))).all()
    assert all(len(set(row)) == kk for row in found)
    got = np.sort(((queries[:, None, :].astype(np.float64) - keys[found].astype(np.float64)) ** 2).sum(-1), axis=1)
    want = brute_best(keys, queries, kk)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * (keys.astype(np.float64) ** 2).sum(1).max())  # fp32 scores
    np.testing.assert_allclose(dist[:, :kk], want, rtol=1e-4, atol=1e-6)  # recomputed in fp32


def clustered(rng, clusters: int, size: int, dim: int) -> np.ndarray:
    """Tight clusters, each stored in a run of rows: many of a query's nearest keys in few tiles."""
    centers = rng.normal(size=(clusters, 1, dim))
    return (centers + rng.normal(size=(clusters, size, dim)) * 0.1).reshape(-1, dim).astype(np.float32)


@pytest.mark.parametrize("case, n, k, chunk", [
    ("random", 10_000, 8, 3000),  # 3000 keys a chunk: tiled (the tail tile 24 long); the last chunk of 1000: plain
    ("random", 10_000, 1, 4096),  # k = 1, whole tiles; a query a block: 3 groups of PASSES blocks
    ("random", 4000, 30, 1 << 20),  # one chunk of 4000 >= 4 x 30 x 32: tiled
    ("random", 3000, 30, 1 << 20),  # 3000 keys: too few for tiles at this k, plain topk
    ("random", 20, 30, 1 << 20),  # fewer keys than k
    ("clustered", 12_000, 40, 6007),  # 30 clusters of 400 in a row, k = 40: the adversarial case for tiles
    ("clustered", 20_000, 100, 1 << 20),  # a query's 100 nearest in one run of 1000 rows
    ("in tiles", 20_000, 100, 1 << 20),  # the same, each 32 consecutive keys of a cluster one of top_k's tiles
    ("duplicates", 9_000, 16, 2500),  # each key 9 times in a row: ties within and across tiles
])
def test_torch_exact_is_exact_against_brute_force(case, n, k, chunk, monkeypatch):
    import monim.storage.torch_search as exact

    rng = np.random.default_rng(n + k)
    dim = 16
    if case == "random":
        keys = rng.normal(size=(n, dim)).astype(np.float32)
        queries = rng.normal(size=(40, dim)).astype(np.float32)
    elif case in ("clustered", "in tiles"):
        keys = clustered(rng, n // 400, 400, dim) if k == 40 else clustered(rng, n // 1000, 1000, dim)
        queries = keys[rng.integers(0, n, 40)] + rng.normal(size=(40, dim)).astype(np.float32) * 0.05
        if case == "in tiles":  # top_k's tile t holds columns t, t + n/32, t + 2n/32, ...: rows 32t..32t+31 go there
            keys = np.ascontiguousarray(keys.reshape(n // exact.TILE, exact.TILE, dim).transpose(1, 0, 2).reshape(n, dim))
    else:
        keys = np.repeat(rng.normal(size=(n // 9, dim)).astype(np.float32), 9, axis=0)
        queries = np.concatenate([keys[rng.integers(0, n, 20)], rng.normal(size=(20, dim)).astype(np.float32)])
    calls = []
    top_k = exact.top_k
    monkeypatch.setattr(exact, "top_k", lambda s, kk: calls.append(s.shape[1]) or top_k(s, kk))
    assert_exact(keys, queries, k, chunk, block=1 if k == 1 else 16)
    assert any(exact.tiles_pay(c, k) for c in calls) == (min(chunk, n) >= 4 * k * exact.TILE)


def test_top_k_in_tiles_is_torch_topk():
    from monim.storage.torch_search import TILE, tiles_pay, top_k

    rng = np.random.default_rng(3)
    rows = [rng.normal(size=5000), np.arange(5000.0), -np.arange(5000.0), np.repeat(rng.normal(size=50), 100),
            np.zeros(5000), np.concatenate([rng.normal(size=4990), 10 + rng.normal(size=10)])]
    for n in (5000, 4999, 4096 + 1, 4 * 8 * TILE):
        s = torch.tensor(np.stack([r[:n] for r in rows]), dtype=torch.float32)
        for k in (1, 8, 37):
            values, at = top_k(s, k)
            want = s.topk(k, dim=1).values
            assert tiles_pay(n, k) == (k <= 37 and n >= 4 * k * TILE)
            np.testing.assert_array_equal(values.sort(1, descending=True).values, want)
            np.testing.assert_array_equal(s.gather(1, at), values)
            assert all(len(set(row.tolist())) == k for row in at)


def test_tile_zero_turns_tiles_off(monkeypatch):
    import monim.storage.torch_search as exact

    s = torch.randn(3, 50_000)
    assert exact.tiles_pay(50_000, 8)
    monkeypatch.setattr(exact, "TILE", 0)  # as benchmarks/gpu.py's plain_topk does
    assert not exact.tiles_pay(50_000, 8)
    values, at = exact.top_k(s, 8)
    np.testing.assert_array_equal(values.sort(1, descending=True).values, s.topk(8, dim=1).values)
