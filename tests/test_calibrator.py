"""The NN calibrator: features against brute force, learning a known λ, and on real news."""

import datetime as dt
import math
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch

from monim.data.day import Day
from monim.data.feed import Document, open_feed
from monim.data.stream import iter_days
from monim.learning.calibration import calibrate
from monim.learning.memorize import memorize_day
from monim.learning.policies import make_policy
from monim.lm.token_scores import TokenScores
from monim.storage import articles
from monim.storage.datastore import Datastore
from monim.storage.entries import Entries
from monim.storage.lexical import LexicalCounts, context_grams, day_counts
from monim.storage.memory_settings import Settings
from monim.theta.calibrator import (
    LAM_CEIL,
    TOP,
    CalibratorConfig,
    Examples,
    density_features,
    examples,
    train_calibrator,
)
from monim.theta.knnlm import LAMBDAS, TEMPERATURES, Interpolation, interpolate, perplexity, theta_scores
from monim.theta.memory import Memory


def brute_lexical(docs: list[list[int]]) -> tuple[Counter, dict]:
    count, succ = Counter(), defaultdict(set)
    for doc in docs:
        for i, tok in enumerate(doc):
            count[tok] += 1
            if i + 1 < len(doc):
                succ[tok].add(doc[i + 1])
    return count, succ


def test_lexical_counts_equal_brute_force_across_commits_and_forget(tmp_path):
    rng = np.random.default_rng(0)
    days = [[list(rng.integers(0, 30, rng.integers(2, 40))) for _ in range(3)] for _ in range(3)]
    days[1][0] += [2**20, 7]  # a token id beyond the others
    ds = Datastore(tmp_path, {"model": "m", "hidden_size": 4, "tokenizer": "t"})

    def text(docs: list[Document]) -> dict:  # a document's text is its token ids, written out
        return day_counts([[int(t) for t in d.text.split()] for d in docs]) | articles.pack(docs)

    def commit(i, force=False):
        entries = Entries(np.zeros((2, 4), np.float16), np.array([1, 2], np.int32), [f"d{i}-0", f"d{i}-1"], np.array([1, 2], np.int32))
        docs = [Document(f"d{i}-{j}", dt.date(2022, 6, i + 1), " ".join(map(str, d))) for j, d in enumerate(days[i])]
        ds.commits.commit_day(f"2022-06-0{i + 1}", entries, 2, "fullmem", force=force, text=text(docs))

    def check(docs):
        count, succ = brute_lexical(docs)
        lex = LexicalCounts.of(Datastore(tmp_path, {"model": "m", "hidden_size": 4, "tokenizer": "t"}).shards)
        prev = np.array([0, 5, 7, 29, 2**20, 2**21, 31])  # 2**21 and 31: never seen
        want = np.log1p([[count[t], len(succ[t])] for t in prev])
        np.testing.assert_allclose(lex.features(prev), want, rtol=1e-6)
        padded = lambda doc: [None] * 3 + list(doc)  # noqa: E731  (a document's start is a context too)
        held = {tuple(padded(d)[p: p + 3]) for d in docs for p in range(len(d))}
        for doc in [d for day in days for d in day] + [[0, 5, 0, 5, 0, 5], [2**20, 7, 3, 3]]:
            want = [tuple(padded(doc)[p: p + 3]) in held for p in range(len(doc))]
            assert lex.seen(context_grams(doc)).tolist() == want, doc

    commit(0)
    check(days[0])
    commit(1)
    commit(2)
    check(days[0] + days[1] + days[2])  # extended from the cached first day
    days[2] = [[3, 4, 5, 3, 4, 6]]
    commit(2, force=True)  # the last day replaced: its old text no longer counts
    check(days[0] + days[1] + days[2])
    ds.commits.forget(days=["2022-06-02"])  # a forgotten day's text is forgotten too
    check(days[0] + days[2])
    ds.commits.forget(doc_ids=["d0-0"], retext=text)  # a forgotten document's text is counted no more, its day's other texts are
    check(days[0][1:] + days[2])
    ds.commits.forget(doc_ids=["d2-1"])  # where the day's text cannot be made again, none of it counts
    check(days[0][1:])
    (tmp_path / "shards" / ds.days[0].shard / "lex_grams.npy").unlink()  # a day from before contexts were kept
    (tmp_path / "lexical.npz").unlink()
    assert LexicalCounts.of(Datastore(tmp_path, {"model": "m", "hidden_size": 4, "tokenizer": "t"}).shards).seen(
        np.arange(5, dtype=np.uint64)).all()  # its contexts unknown: every one may be held


def test_density_features_equal_brute_force():
    rng = np.random.default_rng(1)
    values = rng.integers(-1, 4, (50, 12)).astype(np.int32)
    values[:, 0] = rng.integers(0, 4, 50)
    dist = np.sort(rng.random((50, 12)).astype(np.float32) * 100, axis=1)
    got = density_features(dist, values)
    for r in range(50):
        seen = set()
        for i in range(TOP):
            if values[r, i] >= 0:
                seen.add(values[r, i])
            assert got[r, TOP + i] == len(seen)
            want = math.log1p(dist[r, i]) if values[r, i] >= 0 else math.log1p(1e6)
            assert got[r, i] == pytest.approx(want, rel=1e-5)
    small = density_features(dist[:, :3], values[:, :3])  # fewer neighbours than TOP: padded as missing
    np.testing.assert_array_equal(small[:, TOP : TOP + 3], got[:, TOP : TOP + 3])
    np.testing.assert_array_equal(small[:, TOP + 3 :], np.repeat(got[:, TOP + 2 : TOP + 3], TOP - 3, 1))


def test_examples_read_the_scored_batch(tiny_model_dir, tmp_path):
    """Features of real scored tokens: LM confidence/entropy from full logits, lexical from the text."""
    from monim.lm.model import load_lm

    lm = load_lm(str(tiny_model_dir("llama")))
    docs = [Document(f"d{i}", dt.date(2022, 6, 1), f"Rates rose {i} times as markets fell and rose again.") for i in range(3)]
    memory = Memory(tmp_path, lm)
    memorize_day(memory, Day(dt.date(2022, 6, 1), docs[:2], [docs[2]], []), make_policy("fullmem"))
    batch = memory.score([docs[2]])[0]
    ex = examples(batch, memory.lexical())
    ids = lm.tokenizer(docs[2].text)["input_ids"]
    with torch.no_grad():
        logits = lm.model(torch.tensor([ids[:-1]])).logits[0].double()
    p = torch.softmax(logits, -1)
    np.testing.assert_allclose(ex.distribution[:, 0], p.max(-1).values.numpy(), rtol=1e-4)
    np.testing.assert_allclose(ex.distribution[:, 1], -(p * p.log()).sum(-1).numpy(), rtol=1e-3, atol=1e-4)
    np.testing.assert_array_equal(batch.prev, ids[:-1])
    count, succ = brute_lexical([lm.tokenizer(d.text)["input_ids"] for d in docs[:2]])
    np.testing.assert_allclose(ex.lexical, np.log1p([[count[t], len(succ[t])] for t in ids[:-1]]), rtol=1e-6)
    np.testing.assert_allclose(ex.density, density_features(batch.knn_dist, batch.knn_values))


def synthetic(n: int, seed: int) -> Examples:
    """Half the tokens have a perfect memory (p_kNN = 0.9, close neighbours), half a useless one."""
    rng = np.random.default_rng(seed)
    good = rng.random(n) < 0.5
    dist = np.where(good[:, None], 1.0, 50.0) + rng.random((n, TOP))
    values = np.where(good[:, None], 1, rng.integers(2, 100, (n, TOP)))
    knn = np.where(good, math.log(0.9), math.log(1e-4)).astype(np.float32)
    return Examples(
        key=rng.standard_normal((n, 8)).astype(np.float16),
        distribution=np.stack([rng.random(n), rng.random(n) * 3], 1).astype(np.float32),
        lexical=rng.random((n, 2)).astype(np.float32),
        density=density_features(dist.astype(np.float32), values.astype(np.int32)),
        lm_logp=np.full(n, math.log(0.1), np.float32),
        knn_logp=np.repeat(knn[:, None], len(TEMPERATURES), 1),
        holdout=rng.random(n) < 0.3,
        seen=np.zeros(n, bool),
        doc_id=np.full(n, ""),
    ), good


def test_calibrator_separates_a_useful_memory_from_a_useless_one():
    ex, _ = synthetic(3000, 0)
    test, good = synthetic(1000, 1)
    cfg = CalibratorConfig(max_epochs=5)
    cal = train_calibrator(ex, cfg, lam=0.25, temperature=1.0)
    lam = cal.lam(test)
    assert lam[good].mean() > 0.9 and lam[~good].mean() < 0.1, (lam[good].mean(), lam[~good].mean())
    assert cal.summary["held_out_nll"] < cal.summary["held_out_nll_start"]  # better than the constant λ it started at
    # the ablation switch really removes inputs: without density (and with uninformative other
    # features) nothing separates the two halves
    blind = train_calibrator(ex, cfg.without("density"), lam=0.25, temperature=1.0).lam(test)
    assert abs(blind[good].mean() - blind[~good].mean()) < 0.1
    # warm start keeps training from where yesterday's net stopped
    again = train_calibrator(ex, cfg, 0.25, 1.0, start=cal, epochs=1)
    assert again.summary["warm_start"] and again.summary["held_out_nll_start"] == pytest.approx(cal.summary["held_out_nll"], rel=1e-5)


def test_calibrator_lambda_never_reaches_one():
    """However sure the net is, the LM keeps 1 - LAM_CEIL of the weight: a token whose target the
    neighbours miss costs at most log(1 - LAM_CEIL) nats more than under the LM (at λ = 1.0: -inf)."""
    ex, _ = synthetic(600, 0)
    cal = train_calibrator(ex, CalibratorConfig(max_epochs=1), lam=0.25, temperature=1.0)
    with torch.no_grad():
        cal.net.out.bias.copy_(torch.tensor([-100.0, 100.0]))  # a logit far past float32's λ = 1.0
    lam = cal.lam(ex)
    assert lam.max() == pytest.approx(LAM_CEIL, rel=1e-6) and lam.max() < 1.0
    missed = interpolate(torch.tensor([math.log(0.1)]), torch.tensor([-math.inf]), torch.from_numpy(lam[:1]))
    assert missed.item() == pytest.approx(math.log(0.1) + math.log(1 - LAM_CEIL), rel=1e-6)


def test_per_token_lambda_in_theta_scores_matches_numpy():
    rng = np.random.default_rng(3)
    n, k, V = 20, 6, 30
    lm = torch.log_softmax(torch.from_numpy(rng.standard_normal((n, V))), -1).numpy()
    values = rng.integers(0, V, (n, k)).astype(np.int32)
    values[:4] = -1  # retrieval skipped: the LM alone
    dist = (rng.random((n, k)) * 5).astype(np.float32)
    target = rng.integers(0, V, n).astype(np.int32)
    batch = TokenScores(np.array(["d"] * n, object), np.arange(n, dtype=np.int32), target, target,
                        lm[np.arange(n), target].astype(np.float32), lm.max(1).astype(np.float32), np.zeros(n, np.float32),
                        lm.argmax(1).astype(np.int32), np.zeros((n, 4), np.float16), dist, values,
                        np.take_along_axis(lm, np.clip(values, 0, None), 1).astype(np.float32))
    lam = rng.random(n)
    got = theta_scores(batch, Interpolation(0.5, 2.0), lam)
    for r in range(n):
        w = np.exp(-dist[r] / 2.0)
        pk = np.zeros(V)
        if values[r, 0] >= 0:
            np.add.at(pk, values[r], w / w.sum())
        lr = lam[r] if values[r, 0] >= 0 else 0.0
        p = (1 - lr) * np.exp(lm[r]) + lr * pk
        assert got.logp[r] == pytest.approx(math.log(p[target[r]]), rel=1e-6)
        assert got.max_logp[r] == pytest.approx(math.log(p.max()), rel=1e-6) and got.argmax[r] == p.argmax()


@pytest.mark.slow
def test_calibrated_memory_on_real_news(smollm, data_dir, tmp_path):
    """News repeats itself: some articles come back (syndicated copies), most are new. FullMem
    learns six RealTime QA articles; calibration (the paper's scheme: validation articles) and test
    sets each mix copies of memorized articles with unseen ones. The calibrator's test PPL is below
    the best constant λ of a grid chosen on the TEST set itself."""
    source = open_feed(data_dir / "news" / "realtimeqa-2022-06-to-09.jsonl.gz")
    days = list(iter_days(source, dt.date(2022, 6, 1), dt.date(2022, 6, 8)))
    cut = lambda doc, n=400: smollm.tokenizer.decode(smollm.tokenizer(doc.text)["input_ids"][:n])  # noqa: E731
    trained = [Document(d.id, d.date, cut(d)) for d in days[0].train[:3] + days[1].train[:3]]
    copy = lambda doc: Document(f"copy-of-{doc.id}", doc.date, doc.text)  # noqa: E731
    unseen = [Document(d.id, d.date, cut(d, 300)) for day in days[2:] for d in day.validation + day.test]
    calibration = [copy(trained[0]), copy(trained[3]), *unseen[:6]]
    test = [copy(trained[1]), copy(trained[4]), *unseen[6:]]
    memory = Memory(tmp_path, smollm, Settings(calibrator=CalibratorConfig(source="validation")))
    day = Day(dt.date(2022, 6, 2), trained, calibration, [])
    memorize_day(memory, day, make_policy("fullmem"))
    summary = calibrate(memory, day)
    assert summary["calibrator"]["held_out_nll"] <= summary["calibrator"]["held_out_nll_start"]
    assert not memory.fallback
    full = memory.score(test, skip=False)
    grid = {(lam, t): perplexity(full, Interpolation(lam, t)) for lam in LAMBDAS for t in TEMPERATURES}
    calibrated = math.exp(-np.concatenate([memory.theta_scores(b).logp for b in full]).mean())
    assert calibrated < min(grid.values()), (calibrated, min(grid.items(), key=lambda kv: kv[1]))
