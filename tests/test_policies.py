"""Memorization policies: AMT by hand, RandMem's rate, KL's score, and the daily learning effect."""

import datetime as dt

import numpy as np
import pytest

from monim.knnlm import ThetaScores
from monim.lm import load_lm
from monim.calibration import calibrate
from monim.memorize import memorize_day
from monim.memory import Memory
from monim.policies import KL, MoNIM, RandMem, amt_threshold, key_surprisal
from monim.catalogue import make_policy
from monim.stream import Day, Document, iter_days, open_source


def test_amt_hand_computed():
    assert amt_threshold(-1.5, np.array(0.0)) == -3.0  # x_t already top-1: 2δ, harder to store
    assert amt_threshold(-1.5, np.array(2.5)) == -0.5
    assert -0.02 < amt_threshold(-1.5, np.array(100.0)) < 0  # large margin: close to 0, easy to store
    assert amt_threshold(-1.5, np.array(1.0)) > -1.5 > amt_threshold(-1.5, np.array(0.25))


def theta(logp, max_logp):
    return ThetaScores(np.array(logp), np.array(max_logp), np.zeros(len(logp), np.int32))


def test_monim_fixed_and_adaptive_rules():
    # logp -2.0 as top-1 (margin 0): fixed δ=-1.5 stores it, AMT (threshold -3) does not
    # logp -1.3 with top -0.1 (margin 1.2, threshold -1.5/1.7=-0.88): AMT stores it, fixed does not
    t = theta([-2.0, -1.3, -0.2], [-2.0, -0.1, -0.2])
    assert MoNIM(adaptive=False).select(None, t, None, None).tolist() == [True, False, False]
    assert MoNIM(adaptive=True).select(None, t, None, None).tolist() == [False, True, False]


def test_randmem_rate_and_seed():
    batch = type("B", (), {"__len__": lambda self: 200_000})()
    pick = lambda seed: RandMem(rate=0.3).select(batch, None, None, np.random.default_rng([seed, 7]))  # noqa: E731
    assert abs(pick(0).mean() - 0.3) < 0.005
    assert np.array_equal(pick(0), pick(0)) and not np.array_equal(pick(0), pick(1))


def test_policy_names():
    assert [make_policy(n).name for n in ("fullmem", "randmem", "monim", "monim-amt", "kl")] == \
        ["fullmem", "randmem", "monim", "monim-amt", "kl"]
    with pytest.raises(ValueError, match="unknown policy 'lru'"):
        make_policy("lru")


def test_kl_score_is_key_projected_through_the_unembedding(tiny_model_dir):
    lm = load_lm(str(tiny_model_dir("gpt2")))
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((50, 32)).astype(np.float16)
    targets = rng.integers(0, 50257, 50).astype(np.int32)
    E = lm.model.get_output_embeddings().weight.detach().double().numpy()
    logits = keys.astype(np.float64) @ E.T
    ref = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1) - logits[np.arange(50), targets]
    np.testing.assert_allclose(key_surprisal(lm, keys, targets, chunk=7), ref, rtol=1e-4)
    batch = type("B", (), {"key": keys, "target": targets})()
    keep = KL(rate=0.2).select(batch, None, lm, None)
    assert keep.sum() == 10 and ref[keep].min() >= ref[~keep].max()


def test_memorize_day_with_a_tiny_model(tiny_model_dir, tmp_path):
    lm = load_lm(str(tiny_model_dir("llama")))
    docs = [Document(f"d{i}", dt.date(2022, 6, 1), f"Story number {i} about the markets and rates.") for i in range(4)]
    day = Day(dt.date(2022, 6, 1), docs[:3], [docs[3]], [])
    memory = Memory(tmp_path, lm)
    stats = memorize_day(memory, day, make_policy("fullmem"))
    n_tokens = sum(len(lm.tokenizer(d.text)["input_ids"]) - 1 for d in docs[:3])
    assert stats.committed and stats.tokens_seen == stats.stored == n_tokens and stats.memrate == 1.0
    assert len(memory) == memory.index.ntotal == n_tokens
    assert stats.index == {"added": n_tokens, "removed": 0, "rebuilt": False}  # into the (empty) exact index made before scoring
    size = memory.bytes_on_disk()
    again = memorize_day(Memory(tmp_path, lm), day, make_policy("fullmem"))
    assert not again.committed and again.stored == n_tokens and Memory(tmp_path, lm).bytes_on_disk() == size
    assert memory.ds.days[0].policy == "fullmem" and not memory.ds.theta_at()
    assert (tmp_path / "calibration" / "2022-06-01.npz").exists()  # the day's calibration sample, kept by memorize
    record = calibrate(memory, day)
    theta = memory.ds.theta_at()
    assert record["trained"] and (theta["lam"], theta["temperature"]) == (record["lam"], record["temperature"])
    assert memory.calibrator() is not None and not (tmp_path / "calibration" / "2022-06-01.npz").exists()
    assert record["new_tokens"] == n_tokens + len(lm.tokenizer(docs[3].text)["input_ids"]) - 1  # the sample and validation
    again = calibrate(Memory(tmp_path, lm), day)  # a re-run changes nothing and says what the day's calibration did
    assert not again["trained"] and {k: again[k] for k in ("lam", "nll", "calibration_tokens")} == {
        k: record[k] for k in ("lam", "nll", "calibration_tokens")}
    assert Memory(tmp_path, lm).ds.theta_at() == theta


def article_day(date, text, doc_id):
    return Day(date, [Document(doc_id, date, text)], [], [])


def test_monim_learns_repeated_text_stores_less(smollm, data_dir, tmp_path):
    """Day 2 repeating day 1's article stores far fewer entries than day 2 bringing a new one."""
    days = iter_days(open_source(data_dir / "news" / "realtimeqa-2022-06-to-09.jsonl.gz"), end=dt.date(2022, 6, 2))
    first, second = [d.train[0] for d in days]
    cut = lambda doc: smollm.tokenizer.decode(smollm.tokenizer(doc.text)["input_ids"][:700])  # noqa: E731
    day1 = article_day(dt.date(2022, 6, 1), cut(first), "a")
    stored = {}
    for kind, text in (("repeat", cut(first)), ("new", cut(second))):
        memory = Memory(tmp_path / kind, smollm)
        s1 = memorize_day(memory, day1, make_policy("monim-amt"))
        s2 = memorize_day(memory, article_day(dt.date(2022, 6, 2), text, "b"), make_policy("monim-amt"))
        stored[kind] = s2.memrate
    assert 0.1 < s1.memrate < 0.9  # day 1 against the bare LM stores part of the text
    assert stored["repeat"] < 0.25 * stored["new"], stored
