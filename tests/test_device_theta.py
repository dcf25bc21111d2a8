"""Θ on the LM's device (monim.theta.device.DeviceTheta), proven on the CPU: the same neighbours and
Θ's scores as the host path for each rule, with and without the skip, and the host reads it plans."""

import dataclasses
import datetime as dt
import functools
import shutil

import numpy as np
import pytest
import torch

from helpers import nearest_by_numpy, random_entries
from monim.core.config import DEMO_STREAM
from monim.core.recency import Recency
from monim.data.feed import open_feed
from monim.data.stream import iter_days
from monim.evaluation.evaluate import evaluate, searched, theta_of
from monim.lm.host import reads, to_host
from monim.lm.scoring import score, score_tokens, with_neighbors
from monim.lm.token_scores import OnDevice, TokenScores
from monim.storage.torch_search import TorchExact
from monim.theta.calibrator import examples
from monim.theta.knnlm import theta_scores
from monim.theta.memory import Memory


@pytest.fixture(scope="module")
def docs(theta):
    """Two new articles and one the memory learned (its tokens' nearest entries are copies: never skipped)."""
    new = next(iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 4), dt.date(1987, 3, 4))).train[:2]
    learned = next(iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 2), dt.date(1987, 3, 2))).train[:1]
    return [*new, *learned]


@pytest.fixture(scope="module")
def threshold(theta, docs):
    """A skip threshold θ at the median of the calibrator's λ over the docs: the skip both skips and searches."""
    batch = TokenScores.concat(theta.score(docs, skip=False, on_device=False))
    return float(np.median(theta.calibrator().lam(examples(batch, theta.lexical()))))


def by_row(batch: TokenScores, field: str) -> np.ndarray:
    """A neighbour field with each row's neighbours in id order (the order among equal distances is free)."""
    order = np.argsort(batch.knn_ids, axis=1, kind="stable")
    return np.take_along_axis(getattr(batch, field), order, 1)


@pytest.mark.parametrize("rule", ["constant", "prior", "calibrator"])
@pytest.mark.parametrize("skip", [False, True])
def test_the_device_path_returns_the_host_paths_neighbours_and_theta(theta, docs, threshold, rule, skip):
    memory = Memory.open(theta.ds.root, theta.lm, skip_threshold=threshold)
    host = TokenScores.concat(memory.score(docs, skip=skip, on_device=False))
    device = TokenScores.concat(list(score(memory.lm, docs, memory.settings.window,
                                           memory.on_device(skip, rule))))
    assert host.knn_skipped is not None
    if skip:
        assert 0 < host.knn_skipped.sum() < len(host) - 1
    assert_same(device, host, memory, rule)
    if rule == memory.rule:  # Memory.score's own device path
        same = TokenScores.concat(memory.score(docs, skip=skip, on_device=True))
        assert (same.theta_logp == device.theta_logp).all()


def assert_same(device: TokenScores, host: TokenScores, memory: Memory, rule: str) -> None:
    """The device path's tokens, neighbours and Θ's scores are the host path's (Θ's: by `rule`)."""
    assert device.knn_skipped is not None and host.knn_skipped is not None
    assert (device.doc_id == host.doc_id).all() and (device.position == host.position).all()
    assert (device.knn_skipped == host.knn_skipped).all()
    for field in ("logp", "max_logp", "entropy", "argmax", "key"):
        assert (getattr(device, field) == getattr(host, field)).all(), field
    assert (by_row(device, "knn_ids") == by_row(host, "knn_ids")).all()
    assert (by_row(device, "knn_values") == by_row(host, "knn_values")).all()
    np.testing.assert_allclose(by_row(device, "knn_dist"), by_row(host, "knn_dist"), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(by_row(device, "lm_logp_values"), by_row(host, "lm_logp_values"), rtol=0, atol=1e-5)
    assert (device.knn_prior is None) == (host.knn_prior is None)
    want = theta_scores(host, memory.interpolation, memory.lam(host, rule))
    np.testing.assert_allclose(device.theta_logp, want.logp, rtol=0, atol=1e-4)
    np.testing.assert_allclose(device.theta_max_logp, want.max_logp, rtol=0, atol=1e-4)
    assert (device.theta_argmax == want.argmax).all()


@pytest.mark.parametrize("reading", [dict(half_life=1.0), dict(max_age=0), dict(as_of="1987-03-02")])
def test_the_device_path_reads_the_memory_as_of_a_day_and_by_recency(theta, docs, reading):
    memory = Memory.open(theta.ds.root, theta.lm, **reading)
    host = TokenScores.concat(memory.score(docs, on_device=False))
    device = TokenScores.concat(memory.score(docs, on_device=True))
    assert (host.knn_prior is not None) == ("half_life" in reading)
    days = memory.days if "max_age" not in reading else memory.days[-1:]
    first = memory.ds.shards.shard(days[0].shard, "ids")[0]
    found = host.knn_ids[host.knn_ids >= 0]
    assert found.min() >= first and found.max() < first + sum(d.entries for d in days) <= memory.ds.manifest["next_id"]
    assert_same(device, host, memory, memory.rule)


def test_views_and_variants_share_one_copy_of_the_keys_and_answer_as_the_host(theta, docs):
    memory = Memory.open(theta.ds.root, theta.lm)
    views = [memory.at(memory.days[0].date), memory.recent(Recency(max_age=0)), memory.recent(Recency(half_life=1.0))]
    held = [memory.on_device(), memory.on_device(False, "constant", neighbors=False), *(v.on_device() for v in views)]
    storage = {h.index.keys.untyped_storage().data_ptr() for h in held}
    assert len(storage) == 1 and held[0].index is memory.index.exact_on(memory.ds, memory.lm.device)
    assert held[0].values is held[2].values and held[1].index is held[0].index  # one table of values, variants share
    assert [h.index.ntotal for h in held[2:]] == [memory.days[0].entries, memory.days[-1].entries, len(memory)]
    for view in views:
        host = TokenScores.concat(view.score(docs, on_device=False))
        assert_same(TokenScores.concat(view.score(docs, on_device=True)), host, view, view.rule)


def test_a_forget_or_a_new_day_makes_a_new_state_on_the_device_and_repeated_calls_reuse_it(theta, docs, tmp_path):
    shutil.copytree(theta.ds.root, tmp_path / "m")
    memory = Memory.open(tmp_path / "m", theta.lm)
    first = memory.on_device()
    assert memory.on_device() is first and memory.at(memory.days[-1].date).on_device().index is first.index
    found = TokenScores.concat(memory.score(docs[2:], on_device=True)).knn_ids
    before = memory.ds.shards.array("ids")
    assert memory.forget(doc_ids=[docs[2].id])
    assert not memory._device.tables and memory.index._exact is None  # the old copies let go at once
    gone = np.setdiff1d(before, memory.ds.shards.array("ids"))
    assert np.isin(found, gone).sum() > len(found)  # the learned article's tokens had found its own entries
    after = memory.on_device()
    assert after is not first and after.index.ntotal == first.index.ntotal - len(gone)
    device = TokenScores.concat(memory.score(docs, on_device=True))
    assert not np.isin(device.knn_ids, gone).any()  # nothing forgotten answered from the device
    assert_same(device, TokenScores.concat(memory.score(docs, on_device=False)), memory, memory.rule)
    with memory.writing():
        memory.ds.commits.commit_day("1987-03-04", random_entries(5, dim=memory.lm.hidden_size), 5, "fullmem")
    new_day = memory.on_device()
    assert new_day is not after and new_day.index.ntotal == after.index.ntotal + 5 and memory.on_device() is new_day


@pytest.mark.parametrize("rule", ["constant", "calibrator"])
def test_a_batch_searched_on_the_device_later_is_the_hosts_and_read_once(theta, docs, threshold, rule):
    memory = Memory.open(theta.ds.root, theta.lm, skip_threshold=threshold)
    batch = TokenScores.concat(list(score(memory.lm, docs, memory.settings.window, keep_hidden=True)))
    on_device = memory.on_device(True, rule)
    with reads() as counted:
        device = with_neighbors(memory.lm, batch, on_device, chunk=64)
    assert len(batch) > 3 * 64 and counted == {"to_host": 1}
    assert_same(device, with_neighbors(memory.lm, batch, memory.search), memory, rule)
    scores = with_neighbors(memory.lm, batch, memory.on_device(True, rule, neighbors=False), chunk=64)
    assert memory.on_device(True, rule) is on_device  # made once; its variants share the keys copied up
    assert memory.on_device(True, rule, neighbors=False).index is on_device.index
    assert scores.knn_values is None and scores.knn_dist is None and scores.lm_logp_values is None
    assert (scores.knn_skipped == device.knn_skipped).all() and (scores.theta_logp == device.theta_logp).all()
    on_device.kept = 0.0  # 4 of each chunk's 64 rows searched in full: the chunks that kept more searched again
    with reads() as counted:
        small = with_neighbors(memory.lm, batch, on_device, chunk=64)
    assert counted == {"to_host": 2} and on_device.kept > 4 / 64
    for field in ("knn_ids", "knn_dist", "knn_skipped", "lm_logp_values", "theta_logp"):
        assert (getattr(small, field) == getattr(device, field)).all(), field


class Syncing(OnDevice):
    """A memory on the device with one host read added to each chunk's search (what the counting test must catch)."""

    def __init__(self, inner: OnDevice):
        self.inner = inner

    def rows(self, n):
        return self.inner.rows(n)

    def search(self, chunk, rows=None):
        found = self.inner.search(chunk, rows)
        if bool(found["knn_skipped"].any()):  # a device-waiting `if`
            found["knn_dist"] = found["knn_dist"] + 0
        return found

    def theta(self, chunk):
        return self.inner.theta(chunk)


@pytest.mark.parametrize("rule", ["constant", "prior", "calibrator"])
def test_a_scored_pass_reads_the_host_once_and_an_added_read_is_counted(theta, docs, rule):
    lm = theta.lm
    memory = Memory.open(theta.ds.root, lm, skip_threshold=0.5)
    toks = [t for d in docs for t in lm.tokenizer(d.text)["input_ids"]][:200]
    cfg = dataclasses.replace(memory.settings.window, stride=256, batch_size=1, head_chunk=32)  # one pass, 7 chunks
    assert len(toks) == 200
    on_device = memory.on_device(True, rule)
    assert on_device.skip
    syncing = Syncing(on_device)
    for hook, per_chunk in ((on_device, 0), (syncing, 1)):  # the forward pass reads nothing (monim's own masks)
        passes = score_tokens(lm, [("a", toks, 1)], cfg, hook)
        with reads() as counted:
            scores = next(passes)  # the pass queued, then read once
        assert len(scores) == len(toks) - 1 and next(passes, None) is None
        assert sum(counted.values()) == 1 + 7 * per_chunk, counted
    host = score_tokens(lm, [("a", toks, 1)], cfg, memory.search)
    with reads() as counted:  # today's host path: each chunk read, searched on the host and its values' log P read
        next(host)
    assert counted["to_host"] == 2 * 7


@pytest.mark.parametrize("skipping,kept", [("median", 0.0), ("median", 1.0), ("none", 0.0), ("all", 0.0)])
def test_the_skip_searches_the_kept_rows_only_and_a_bucket_too_small_costs_one_read_more(theta, docs, threshold,
                                                                                         skipping, kept):
    """A pass's kept rows searched in full `rows` at a time, sized by the last pass read (`kept`: a
    share of each chunk's rows, 0 at first here, 1 as in a first pass); the chunks whose kept rows
    outgrew it searched again once read: the same results as every row searched, one read more."""
    lm = theta.lm
    theta_of_ = dict(median=threshold, none=0.0, all=1.0)[skipping]
    memory = Memory.open(theta.ds.root, lm, skip_threshold=theta_of_)
    toks = [t for d in docs[:2] for t in lm.tokenizer(d.text)["input_ids"]][:200]
    cfg = dataclasses.replace(memory.settings.window, stride=256, batch_size=1, head_chunk=32)  # one pass, 7 chunks
    on_device = memory.on_device(True)
    on_device.kept = kept
    assert on_device.rows(32) == (None if kept else 2)  # (None: every row, in one search)
    with reads() as counted:
        device = next(score_tokens(lm, [("a", toks, 1)], cfg, on_device))
    host = next(score_tokens(lm, [("a", toks, 1)], cfg, functools.partial(memory.search, skip=True)))
    assert device.knn_skipped is not None and host.knn_skipped is not None
    kept_rows = np.add.reduceat(~host.knn_skipped, np.arange(0, len(host), 32))
    assert {"median": 0 < kept_rows.sum() < len(host), "none": not host.knn_skipped.any(),
            "all": host.knn_skipped.all()}[skipping]
    missed = (kept_rows > (32 if kept else 2)).any()  # a chunk's kept rows beyond those searched in full
    assert missed == (skipping != "all" and not kept)
    assert sum(counted.values()) == 1 + missed, counted
    sizes = np.diff(np.r_[np.arange(0, len(host), 32), len(host)])
    assert on_device.kept == (kept_rows / sizes).max()  # sized by this pass (and the one before: none here)
    assert_same(device, host, memory, memory.rule)
    on_device.kept = 1.0  # every row searched in full, in one search (a first pass): the same numbers
    again = next(score_tokens(lm, [("a", toks, 1)], cfg, on_device))
    for field in ("knn_dist", "knn_ids", "knn_values", "knn_skipped", "lm_logp_values", "theta_logp", "theta_argmax"):
        assert (getattr(again, field) == getattr(device, field)).all(), field


def test_the_counter_sees_hidden_reads_under_inference_mode():
    t = torch.arange(4.0)
    with torch.inference_mode(), reads() as counted:
        to_host(t), to_host({"a": t, "b": t})
        t.sum().item(), bool(t[0] > 0), int(t[1]), float(t[2]), t.tolist(), t.numpy(), t.cpu()
        t[t > 1], t.nonzero(), torch.unique(t), t[t.argmax()]  # the last: a 0-d index read inside torch's own op
    assert counted == {"to_host": 2, "item": 2, "__bool__": 1, "__int__": 1, "__float__": 1, "tolist": 1, "numpy": 1,
                       "cpu": 1, "index": 1, "nonzero": 1, "_unique2": 1}
    with reads() as counted:  # on the device's side: nothing read
        torch.where(t > 1, t, 0).cumsum(0).topk(2)
    assert not counted


def test_a_search_on_the_device_is_exact_with_ties_by_id_and_reads_nothing():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((3000, 16)).astype(np.float16)
    keys[2000:2100] = keys[:100]  # equal keys: equal distances, ordered by id
    ids = np.arange(3000) * 3 + 7
    queries = keys[rng.integers(0, 3000, 50)].astype(np.float32) + rng.standard_normal((50, 16)).astype(np.float32) * 0.1
    index = TorchExact.from_parts([(keys, ids)], len(keys), 16, "cpu")
    with reads() as counted:
        dist, found = index.search_on(torch.from_numpy(queries), 40, block=16)
    assert not counted
    want_d, want_rows = nearest_by_numpy(queries, keys.astype(np.float32), 40)
    np.testing.assert_allclose(dist.numpy(), want_d, rtol=1e-5, atol=1e-5)
    d64 = ((queries[:, None].astype(np.float64) - keys[None].astype(np.float64)) ** 2).sum(-1)
    by_id = np.lexsort((np.broadcast_to(ids, d64.shape), d64), axis=1)[:, :30]  # distance, then id
    assert (found.numpy()[:, :30] == ids[by_id]).all()  # (which of two equal keys is the k-th is free)
    assert sum(len(np.intersect1d(f, ids[2000:2100])) > 0 for f in found.numpy()[:, :30]) > 5  # ties were met
    assert (index.search(queries, 40)[1].shape == (50, 40)) and (index.search_on(torch.from_numpy(queries), 3001)[1][:, 3000] == -1).all()


@pytest.mark.parametrize("skip", [None, "median"])
def test_an_evaluation_on_the_device_is_the_hosts(theta, docs, threshold, skip):
    reading = {"skip_threshold": threshold} if skip else {}
    host, device = (Memory.open(theta.ds.root, theta.lm, **reading) for _ in range(2))
    device._device_choice = (len(device), True)  # as on a GPU whose searches run in torch
    assert device.searched_on_device and not host.searched_on_device
    want, got = evaluate(theta.lm, docs, host), evaluate(theta.lm, docs, device)
    assert device._device.thetas and not host._device.thetas  # each searched where it says
    assert set(got) == set(want) and got["tokens"] == want["tokens"] and got["skipped"] == want["skipped"]
    assert (got["skipped"] > 0) == bool(skip)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-6, nan_ok=True), key


def test_thetas_scores_on_a_batch_count_only_for_the_memory_that_searched_it(theta, docs):
    """A batch carrying Θ's scores from the device: the LM alone's scores without a memory, and a
    batch searched again on the device keeps nothing of an earlier search but what it read."""
    memory = Memory.open(theta.ds.root, theta.lm)
    carried = TokenScores.concat(memory.score(docs, on_device=True))
    assert carried.theta_logp is not None and not np.allclose(carried.theta_logp, carried.logp)
    assert (theta_of(carried, None).logp == carried.logp).all()
    batch = TokenScores.concat(list(score(memory.lm, docs, memory.settings.window, keep_hidden=True)))
    on_host = with_neighbors(memory.lm, batch, memory.search)
    again = with_neighbors(memory.lm, on_host, memory.on_device(neighbors=False))
    assert again.knn_values is None and again.knn_ids is None and again.lm_logp_values is None
    assert again.theta_logp is not None and again.knn_skipped is not None
    memory._device_choice = (len(memory), True)  # as on a GPU whose searches run in torch
    b = searched(memory.lm, batch, memory)
    assert (theta_of(b, memory).logp == again.theta_logp).all()
