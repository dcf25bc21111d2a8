"""Exact search in torch (the GPU path without FAISS's GPU build) against brute force, and the
choice of where a memory is searched."""

import faiss
import numpy as np
import pytest
import torch

from monim.exact import TorchExact, search_backend
from monim.index import IndexConfig, backend

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
