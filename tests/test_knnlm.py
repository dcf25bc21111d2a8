"""kNN-LM scoring against an independent brute-force numpy implementation (exact index)."""

import numpy as np
import pytest
import torch

from monim.lm.token_scores import TokenScores
from monim.storage.datastore import Datastore
from monim.storage.entries import Entries
from monim.storage.index import IndexConfig, MemoryIndex
from monim.theta.knnlm import (
    TEMPERATURES,
    Interpolation,
    interpolate,
    knn_full_logprobs,
    knn_log_weights,
    knn_logprobs_by_temperature,
    knn_target_logprob,
    perplexity,
    theta_scores,
    tune_interpolation,
)

V, D, N, K, T = 40, 16, 600, 32, 8.0


@pytest.fixture
def memory(tmp_path):
    """A datastore of random fp16 keys with a small vocabulary, and its exact index."""
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((N, D)).astype(np.float16)
    values = rng.integers(0, V, N).astype(np.int32)
    ds = Datastore(tmp_path, {"model": "random", "hidden_size": D, "tokenizer": "vocab"})
    ds.commits.commit_day("2022-06-01", Entries(keys, values, ["d"] * N, np.arange(N)), N, "fullmem")
    index = MemoryIndex(tmp_path, D, IndexConfig(k=K))
    index.sync(ds)
    queries = rng.standard_normal((25, D)).astype(np.float32)
    return ds, index, queries, keys.astype(np.float64), values


def brute_force(queries, keys, values, k, temperature):
    """Numpy reference: exact k nearest by squared L2, softmax(-d/T), summed per value: [n, V]."""
    d = ((queries[:, None, :].astype(np.float64) - keys[None]) ** 2).sum(-1)
    nn = np.argsort(d, axis=1)[:, :k]
    dn = np.take_along_axis(d, nn, 1)
    w = np.exp(-(dn - dn.min(1, keepdims=True)) / temperature)
    w /= w.sum(1, keepdims=True)
    p = np.zeros((len(queries), V))
    for i in range(len(queries)):
        np.add.at(p[i], values[nn[i]], w[i])
    return p


def search(memory):
    ds, index, queries, keys, values = memory
    dist, ids = index.search(queries)
    return torch.from_numpy(dist), torch.from_numpy(ds.shards.values_by_id()[ids]).long()


def test_target_and_full_paths_equal_brute_force(memory):
    ds, index, queries, keys, values = memory
    ref = brute_force(queries, keys, values, K, T)
    dist, vals = search(memory)
    logw = knn_log_weights(dist, vals, T)
    full = knn_full_logprobs(logw, vals, V).exp().numpy()
    np.testing.assert_allclose(full, ref, atol=1e-5)
    targets = torch.from_numpy(np.random.default_rng(1).integers(0, V, len(queries)))
    targets[:5] = vals[:5, 0]  # some targets surely among the neighbours
    target_p = knn_target_logprob(logw, vals, targets).exp().numpy()
    np.testing.assert_allclose(target_p, ref[np.arange(len(queries)), targets.numpy()], atol=1e-5)
    np.testing.assert_allclose(target_p, full[np.arange(len(queries)), targets.numpy()], atol=1e-12)


def test_logprobs_by_temperature_equal_brute_force(memory):
    """Every temperature's log p_kNN(target), as calibration reads them; a row without neighbours: -inf."""
    ds, index, queries, keys, values = memory
    dist, vals = search(memory)
    targets = np.random.default_rng(2).integers(0, V, len(queries)).astype(np.int32)
    targets[:5] = vals[:5, 0].numpy()
    none = np.full((1, K), -1, np.int32)
    batch = TokenScores(
        doc_id=np.array(["q"] * (len(queries) + 1), dtype=object), position=np.zeros(len(queries) + 1, np.int32),
        prev=np.append(targets, 0), target=np.append(targets, 0), logp=np.zeros(len(queries) + 1, np.float32),
        max_logp=np.zeros(len(queries) + 1, np.float32), entropy=np.zeros(len(queries) + 1, np.float32),
        argmax=np.zeros(len(queries) + 1, np.int32), key=np.zeros((len(queries) + 1, D), np.float16),
        knn_dist=np.concatenate([dist.numpy(), np.full((1, K), np.inf, np.float32)]),
        knn_values=np.concatenate([vals.numpy().astype(np.int32), none]))
    got = knn_logprobs_by_temperature(batch)
    for j, t in enumerate(TEMPERATURES):
        ref = brute_force(queries, keys, values, K, t)[np.arange(len(queries)), targets]
        np.testing.assert_allclose(np.exp(got[:-1, j]), ref, atol=1e-5, err_msg=f"T = {t}")  # FAISS: fp32 distances
        assert (got[:-1, j][ref == 0] == -np.inf).all()  # a target among no neighbour: -inf, not the lowest float
    assert (got[-1] == -np.inf).all()


def test_missing_neighbours_weigh_nothing():
    dist = torch.tensor([[1.0, 2.0, np.inf], [np.inf, np.inf, np.inf]])
    vals = torch.tensor([[3, 3, -1], [-1, -1, -1]])
    logw = knn_log_weights(dist, vals, 1.0)
    assert logw[0, 2] == -np.inf and torch.isclose(logw[0, :2].exp().sum(), torch.tensor(1.0, dtype=torch.float64))
    assert knn_target_logprob(logw, vals, torch.tensor([3, 3]))[1] == -np.inf
    assert knn_target_logprob(logw, vals, torch.tensor([3, 3]))[0].abs() < 1e-12


def test_interpolation_in_log_space():
    lm, knn = torch.log(torch.tensor([0.2, 0.5])), torch.log(torch.tensor([0.6, 0.0]))
    got = interpolate(lm, knn, 0.25).exp().numpy()
    np.testing.assert_allclose(got, [0.75 * 0.2 + 0.25 * 0.6, 0.75 * 0.5], rtol=1e-6)
    per_row = interpolate(lm, knn, torch.tensor([0.0, 1.0])).exp().numpy()
    np.testing.assert_allclose(per_row, [0.2, 0.0], atol=1e-7)


def fake_batch(memory, seed=2):
    """TokenScores for the queries with a random LM distribution (full log-probs known)."""
    ds, index, queries, keys, values = memory
    rng = np.random.default_rng(seed)
    lm_logp = torch.log_softmax(torch.from_numpy(rng.standard_normal((len(queries), V)) * 2), -1).numpy()
    dist, ids = index.search(queries)
    vals = ds.shards.values_by_id()[ids]
    target = rng.integers(0, V, len(queries)).astype(np.int32)
    n = len(queries)
    batch = TokenScores(
        doc_id=np.array(["q"] * n, dtype=object), position=np.arange(n, dtype=np.int32), prev=target, target=target,
        logp=lm_logp[np.arange(n), target].astype(np.float32), max_logp=lm_logp.max(1).astype(np.float32),
        entropy=np.zeros(n, np.float32), argmax=lm_logp.argmax(1).astype(np.int32),
        key=queries.astype(np.float16), knn_dist=dist, knn_values=vals,
        lm_logp_values=np.take_along_axis(lm_logp, vals, 1).astype(np.float32),
    )
    return batch, lm_logp


def test_theta_scores_equal_the_full_interpolated_distribution(memory):
    ds, index, queries, keys, values = memory
    batch, lm_logp = fake_batch(memory)
    lam = 0.3
    ref = np.log((1 - lam) * np.exp(lm_logp.astype(np.float32).astype(np.float64)) + lam * brute_force(queries, keys, values, K, T))
    got = theta_scores(batch, Interpolation(lam, T), chunk=7)
    n = np.arange(len(queries))
    np.testing.assert_allclose(got.logp, ref[n, batch.target], atol=1e-5)
    np.testing.assert_allclose(got.max_logp, ref.max(1), atol=1e-5)
    np.testing.assert_array_equal(got.argmax, ref.argmax(1))


def test_tuning_picks_the_grid_optimum(memory):
    ds, index, queries, keys, values = memory
    batch, lm_logp = fake_batch(memory, seed=3)
    lambdas, temps = (0.1, 0.5, 0.9), (0.5, 8.0, 100.0)
    best, nll = tune_interpolation([batch], lambdas, temps)
    n = np.arange(len(queries))
    grid = {(lam, t): -np.log((1 - lam) * np.exp(batch.logp.astype(np.float64))
                              + lam * brute_force(queries, keys, values, K, t)[n, batch.target]).mean()
            for lam in lambdas for t in temps}
    want = min(grid, key=grid.get)
    assert (best.lam, best.temperature) == want and abs(nll - grid[want]) < 1e-5
    assert perplexity([batch], best) == pytest.approx(np.exp(grid[want]), rel=1e-5)
    assert perplexity([batch]) == pytest.approx(np.exp(-batch.logp.astype(np.float64).mean()), rel=1e-6)
