"""Greedy Merging: hand-built clusters, the committed weights, and the kNN distribution they weigh."""

import datetime as dt

import numpy as np
import pytest

from monim.core.config import DEMO_STREAM
from monim.data.feed import open_feed
from monim.data.stream import iter_days
from monim.learning.memorize import memorize_day
from monim.learning.merging import greedy_merge
from monim.learning.policies import make_policy
from monim.storage.entries import Entries
from monim.storage.index import IndexConfig
from monim.storage.memory_settings import Settings
from monim.theta.memory import Memory


def cluster(center: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    return (center + 0.01 * rng.standard_normal((n, len(center)))).astype(np.float16)


def test_same_value_neighbours_merge_into_one_weighted_entry(tiny, tmp_path):
    """Yesterday: a (value 5), b (6), c (5) and e (5, weight 2 already). Today: three entries of
    value 5 and one of 7. k = 9 reaches all eight, so whatever the order the first value-5 entry
    taken absorbs the other new ones, a and c (weight 5); b, e (its weight is not 1) and the 7 stay."""
    rng = np.random.default_rng(0)
    d = tiny.hidden_size
    memory = Memory(tmp_path, tiny, Settings(calibrated=False, index=IndexConfig(k=9)))
    old = rng.standard_normal((4, d)).astype(np.float16)
    memory.ds.commits.commit_day("2022-06-01", Entries(old, np.array([5, 6, 5, 5], np.int32), ["d0"] * 4, np.arange(4, dtype=np.int32)),
                         5, "greedy-merge", weights=np.array([1, 1, 1, 2], np.int32))
    memory.sync()
    new = Entries(rng.standard_normal((4, d)).astype(np.float16), np.array([5, 7, 5, 5], np.int32), ["d1"] * 4,
                  np.arange(4, dtype=np.int32))
    for seed in range(5):
        keep, weights, merged = greedy_merge(memory, new, 9, np.random.default_rng(seed))
        assert keep.sum() == 2 and keep[1] and sorted(weights.tolist()) == [1, 5] and merged.tolist() == [0, 2]
    memory.ds.commits.commit_day("2022-06-02", new.take(keep), 4, "greedy-merge", weights=weights, merged=merged)
    rec = memory.ds.days
    assert (rec[0].entries, rec[0].merged, rec[1].entries, len(memory.ds)) == (2, 2, 2, 4)
    table = memory.ds.shards.weights_by_id()
    assert table[[1, 3]].tolist() == [1, 2] and sorted(table[[4, 5]].tolist()) == [1, 5]
    assert table[[1, 3, 4, 5]].sum() == 9  # every token seen is one entry's weight
    memory.sync()
    assert memory.index.ntotal == 4 and not {0, 2} & set(memory.nearest(old.astype(np.float32), 4)[1].ravel())


def test_weights_enter_the_knn_distribution_as_log_priors(tiny, tmp_path):
    """p_kNN(v) = sum over neighbours with value v of w_j exp(-d_j/T), normalized: against numpy."""
    rng = np.random.default_rng(1)
    d, T = tiny.hidden_size, 4.0
    memory = Memory(tmp_path, tiny, Settings(calibrated=False, index=IndexConfig(k=4)))
    keys = rng.standard_normal((4, d)).astype(np.float16)
    values = np.array([3, 4, 3, 9], np.int32)
    memory.ds.commits.commit_day("2022-06-01", Entries(keys, values, ["d"] * 4, np.arange(4, dtype=np.int32)), 9, "greedy-merge",
                         weights=np.array([5, 1, 2, 1], np.int32))
    memory.ds.commits.set_theta({"date": "2022-06-01", "lam": 0.5, "temperature": T})
    memory.sync()
    import torch

    from monim.lm.token_scores import TokenScores
    from monim.theta.knnlm import knn_log_weights, knn_target_logprob

    q = rng.standard_normal((1, d)).astype(np.float16)
    batch = TokenScores(np.array(["q"], object), *(np.zeros(1, np.int32),) * 3, *(np.zeros(1, np.float32),) * 3,
                        np.zeros(1, np.int32), q)
    found = memory.search(batch)
    logw = knn_log_weights(torch.from_numpy(found.dist), torch.from_numpy(found.values).long(), T,
                           torch.from_numpy(found.prior))
    got = knn_target_logprob(logw, torch.from_numpy(found.values).long(), torch.tensor([3])).item()
    dist = ((keys.astype(np.float64) - q.astype(np.float64)) ** 2).sum(1)
    w = np.array([5, 1, 2, 1]) * np.exp(-(dist - dist.min()) / T)
    assert got == pytest.approx(np.log(w[values == 3].sum() / w.sum()), rel=1e-4)


def test_a_greedy_merge_day_stores_less_than_it_saw_and_reruns_change_nothing(tiny, tmp_path):
    days = list(iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 2), dt.date(1987, 3, 3)))
    memory = Memory(tmp_path, tiny, Settings(calibrated=False))
    policy = make_policy("greedy-merge")
    stats = [memorize_day(memory, day.capped(3), policy) for day in days]
    weights = memory.ds.shards.weights_by_id()
    held = np.concatenate([memory.ds.shards.shard(r.shard, "ids") for r in memory.ds.days])
    assert sum(s.tokens_seen for s in stats) == weights[held].sum()  # every token seen is one entry's weight
    assert len(memory) < sum(s.tokens_seen for s in stats) and memory.ds.days[0].merged >= 0
    before = memory.ds.manifest
    assert not memorize_day(memory, days[1].capped(3), policy).committed and memory.ds.manifest == before
