"""Memorization policies: AMT by hand, RandMem's rate, KL's score, and the daily learning effect."""

import datetime as dt
import shutil

import numpy as np
import pytest

from monim.core import catalogue
from monim.core.config import PolicyConfig
from monim.data.day import Day
from monim.data.feed import Document, open_feed
from monim.data.stream import iter_days
from monim.learning.calibration import calibrate
from monim.learning.memorize import memorize_day
from monim.learning.policies import KL, MoNIM, RandMem, key_surprisal, make_policy, policy_params
from monim.learning.threshold import amt_threshold
from monim.lm.model import load_lm
from monim.storage.datastore import Datastore
from monim.theta.calibrator import LAM_CEIL
from monim.theta.knnlm import ThetaScores
from monim.theta.memory import Memory


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


def test_each_memory_policy_is_made_with_the_policy_fields_its_name_reads():
    cfg = PolicyConfig(delta=-2.0, rate=0.3, merge_k=5, search_margin=0.25, search_context=True)
    fixed = {"monim": {"adaptive": False, "in_context": False}, "monim-amt": {"adaptive": True, "in_context": False},
             "ralm+monim-amt": {"adaptive": True, "in_context": True}}
    for name in catalogue.names(catalogue.MEMORY):
        policy = make_policy(name, cfg)
        read = {{"merge_k": "k"}.get(f, f): getattr(cfg, f) for f in catalogue.policy_info(name).reads if not f.startswith("ralm_")}
        assert policy.name == name and policy_params(policy) == read | fixed.get(name, {})


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


@pytest.mark.slow
def test_monim_learns_repeated_text_stores_less(smollm, data_dir, tmp_path):
    """Day 2 repeating day 1's article stores far fewer entries than day 2 bringing a new one."""
    days = iter_days(open_feed(data_dir / "news" / "realtimeqa-2022-06-to-09.jsonl.gz"), end=dt.date(2022, 6, 2))
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


def theta_draws(rng, n, vocab, lam_max):
    """n random tokens: an LM distribution over `vocab` (peaked to flat; float32 log probs as the LM
    gives them), a target (often the LM's top one), λ in [0, λ_max] (often an end) and a P_kNN
    (all on the target, all on the LM's top token, all on another token, or spread at random)."""
    logits = rng.standard_normal((n, vocab)) * rng.choice([0.3, 2.0, 6.0, 15.0], n)[:, None]
    lm = np.log(np.exp(logits - logits.max(1, keepdims=True)) / np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True))
    lm = lm.astype(np.float32).astype(np.float64)
    top = lm.argmax(1)
    target = np.where(rng.random(n) < 0.3, top, rng.integers(0, vocab, n))
    lam = np.select([rng.random(n) < 0.3, rng.random(n) < 0.15], [lam_max, 0.0], rng.uniform(0, lam_max, n))
    knn = rng.dirichlet(np.full(vocab, 0.3), n)
    onto = rng.integers(0, 4, n)  # 0: spread, 1: the target, 2: the LM's top token, 3: another token
    other = (target + 1 + rng.integers(0, vocab - 1, n)) % vocab
    for kind, at in ((1, target), (2, top), (3, other)):
        rows = onto == kind
        knn[rows] = 0.0
        knn[rows, at[rows]] = 1.0
    theta = np.log((1 - lam)[:, None] * np.exp(lm) + lam[:, None] * knn)
    rows = np.arange(n)
    return lm[rows, target], lm.max(1), theta[rows, target], theta.max(1)


@pytest.mark.parametrize("adaptive", [True, False])
def test_a_certain_decision_is_the_decision_of_every_theta(adaptive):
    """Brute force: for every token called certain, Θ (any λ <= λ_max, any P_kNN) decides as it said."""
    rng = np.random.default_rng(0)
    certain_seen = 0
    for delta in (-0.5, -1.5, -3.0):
        policy = MoNIM(delta=delta, adaptive=adaptive)
        for lam_max in (0.05, 0.25, 0.5, 0.9):
            for vocab in (2, 16, 200):
                p, m, logp, max_logp = theta_draws(rng, 4000, vocab, lam_max)
                store, skip = policy.decided(p.astype(np.float32), m.astype(np.float32), lam_max)
                assert not (store & skip).any()
                actual = policy.select(None, theta(logp, max_logp), None, None)
                assert actual[store].all() and not actual[skip].any(), (delta, lam_max, vocab)
                lm_alone = policy.select(None, theta(p, m), None, None)  # λ = 0: what an unsearched token gets
                assert lm_alone[store].all() and not lm_alone[skip].any()
                certain_seen += (store | skip).sum()
    assert certain_seen > 50_000  # the draws did put the bound to work


def test_certain_decisions_by_hand():
    amt, fixed = MoNIM(-1.5, adaptive=True), MoNIM(-1.5, adaptive=False)
    lg = np.log
    # p = m = 0.9 (x_t is the LM's top token), λ_max 0.25: L >= log(0.75*0.9) = log 0.675 = -0.393,
    # M <= log(0.25 + 0.675) = log 0.925 = -0.078; g >= -0.393*(-0.078 + 0.393 + 0.5) = -0.320 >= -1.5: skipped for sure
    store, skip = amt.decided(np.array([lg(0.9)]), np.array([lg(0.9)]), 0.25)
    assert skip.tolist() == [True] and store.tolist() == [False]
    # p = 0.001, m = 0.9, λ_max 0.25: L <= log(0.25 + 0.00075) = -1.383, M >= log(0.675) = -0.393;
    # g <= -1.383*(-0.393 + 1.383 + 0.5) = -2.06 < -1.5: stored for sure (with the fixed δ too: -1.383 < -1.5? no)
    store, skip = amt.decided(np.array([lg(0.001)]), np.array([lg(0.9)]), 0.25)
    assert store.tolist() == [True] and skip.tolist() == [False]
    assert not fixed.certain(np.array([lg(0.001)]), np.array([lg(0.9)]), 0.25)[0]  # L could reach -1.383 >= -1.5
    # fixed δ, λ_max 0.1: L <= log(0.1 + 0.9*0.1) = log 0.19 = -1.66 < -1.5: stored for sure
    assert fixed.decided(np.array([lg(0.1)]), np.array([lg(0.5)]), 0.1)[0].tolist() == [True]
    # p = m = 0.3, λ_max 0.25: L in [log 0.225, log 0.475] = [-1.492, -0.744], M <= log 0.475; g(L_lo, M_hi) =
    # -1.492*(-0.744 + 1.492 + 0.5) = -1.862 < -1.5 and g(L_hi, M_lo) = -0.744*0.5 = -0.372 >= -1.5: uncertain
    assert not amt.certain(np.array([lg(0.3)]), np.array([lg(0.3)]), 0.25)[0]
    # λ_max 0: Θ is the LM, every token is certain (but those within the rounding slack of δ); the
    # calibrator's ceiling 0.99: none is
    rng = np.random.default_rng(1)
    p, m, _, _ = theta_draws(rng, 2000, 50, 0.0)
    assert amt.certain(p, m, 0.0).mean() > 0.99 and fixed.certain(p, m, 0.0).mean() > 0.99
    assert not amt.certain(p, m, LAM_CEIL).any() and not fixed.certain(p, m, LAM_CEIL).any()


def entries(memory):
    ds = memory.ds
    return {a: np.concatenate([np.asarray(ds.shards.shard(d.shard, a)) for d in ds.days]) for a in ("ids", "keys", "values", "docs", "positions")}


EXACT = {"search_margin": None, "search_context": False}  # MoNIM deciding every token the memory could flip


def start_and_day2(smollm, data_dir, tmp_path) -> tuple[Day, list[int]]:
    """A memory of day 1's article (constant λ) in tmp_path / "start", and day 2: a repeat of it and a
    new one; with day 1's tokens."""
    days = iter_days(open_feed(data_dir / "news" / "realtimeqa-2022-06-to-09.jsonl.gz"), end=dt.date(2022, 6, 2))
    first, second = [d.train[0] for d in days]
    cut = lambda doc, n: smollm.tokenizer.decode(smollm.tokenizer(doc.text)["input_ids"][:n])  # noqa: E731
    start = Memory(tmp_path / "start", smollm)
    day1 = article_day(dt.date(2022, 6, 1), cut(first, 600), "a")
    memorize_day(start, day1, make_policy("fullmem"))
    assert start.rule == "constant" and start.lam_max == start.interpolation.lam == 0.25
    return Day(dt.date(2022, 6, 2), [Document("b", dt.date(2022, 6, 2), cut(first, 400)),  # a repeat: the memory matters
                                     Document("c", dt.date(2022, 6, 2), cut(second, 400))], [], []), \
        smollm.tokenizer(day1.train[0].text)["input_ids"]


def memorized(smollm, tmp_path, name, day, policy, **how):
    shutil.copytree(tmp_path / "start", tmp_path / name)
    memory = Memory(tmp_path / name, smollm)
    return memorize_day(memory, day, policy, **how), entries(memory)


@pytest.mark.slow
def test_the_decision_skip_stores_exactly_what_searching_every_token_stores(smollm, data_dir, tmp_path):
    """Day 2 memorized onto the same memory (constant λ) with and without the skip: the same entries."""
    day2, _ = start_and_day2(smollm, data_dir, tmp_path)
    stats, stored = {}, {}
    for skip in (True, False):
        stats[skip], stored[skip] = memorized(smollm, tmp_path, str(skip), day2, make_policy("monim-amt", **EXACT),
                                              decision_skip=skip)
    assert stats[False].searched == stats[False].tokens_seen == stats[True].tokens_seen
    assert 0 < stats[True].searched < 0.8 * stats[True].tokens_seen, stats[True]  # part of the tokens were certain
    for skip in (True, False):  # what the index regime reads (monim.storage.index.exact_limit)
        assert Datastore.read(tmp_path / str(skip)).days[-1].searched == stats[skip].searched
    assert stats[True].stored == stats[False].stored > 0
    for a in stored[True]:
        np.testing.assert_array_equal(stored[True][a], stored[False][a], a)
    bare = Memory(tmp_path / "bare", smollm)  # the memory did change decisions: the bare LM stores another set
    assert memorize_day(bare, day2, make_policy("monim-amt", **EXACT)).stored != stats[True].stored


@pytest.mark.slow
def test_the_decision_leaves_to_the_lm_only_the_tokens_its_margin_and_context_settle(smollm, data_dir, tmp_path):
    """With a search margin and the context rule, every searched token is decided as before; the only
    tokens that may be stored differently are, worked out here from the LM's statistics and day 1's
    tokens, those the LM alone keeps out by more than the margin, or stores where day 1's text has no
    token with the same 3 tokens before it, and that are no probe (one position in 16, searched anyway)."""
    day2, day1_ids = start_and_day2(smollm, data_dir, tmp_path)
    exact, _ = memorized(smollm, tmp_path, "exact", day2, make_policy("monim-amt", **EXACT))
    rough, _ = memorized(smollm, tmp_path, "rough", day2, make_policy("monim-amt", search_margin=0.5, search_context=True))
    batches = list(Memory(tmp_path / "start", smollm).features().scores(day2.train, "by-hand"))
    lp, mp = (np.concatenate([getattr(b, f) for b in batches]).astype(np.float64) for f in ("logp", "max_logp"))
    slack = lp * (np.maximum(mp - lp, 0) + 0.5) + 1.5  # g(L, M) - δ under the LM alone
    token = [(str(d), int(p)) for b in batches for d, p in zip(b.doc_id, b.position)]
    padded = lambda ids: [None] * 3 + list(ids)  # noqa: E731  (a document's start is a context too)
    held = {tuple(padded(day1_ids)[p: p + 3]) for p in range(len(day1_ids))}
    ids = {d.id: padded(smollm.tokenizer(d.text)["input_ids"]) for d in day2.train}
    unseen = {(d, p) for d, p in token if tuple(ids[d][p: p + 3]) not in held}
    skip_side = {t for t, s in zip(token, slack) if s > 0.5}
    store_side = {t for t, s in zip(token, slack) if s < 0} & unseen
    settled = skip_side | store_side
    probes = {t for t in settled if t[1] % 16 == 0}
    def kept(name: str) -> set[tuple[str, int]]:  # day 2's stored tokens as (document, position)
        ds = Memory(tmp_path / name, smollm).ds
        shard = ds.days[-1].shard
        names = ds.shards.shard_docs(shard)
        return {(names[d], int(p)) for d, p in zip(ds.shards.shard(shard, "docs"), ds.shards.shard(shard, "positions"))}

    assert kept("rough") ^ kept("exact") <= settled - probes
    assert len(skip_side) > len(token) / 4 and len(store_side) > len(token) / 10  # both rules left tokens out
    assert len([t for t in store_side if t[0] == "b"]) < len([t for t in store_side if t[0] == "c"])  # b repeats day 1
    assert (rough.settled, rough.probed) == (len(settled), len(probes))
    assert exact.searched - len(settled - probes) <= rough.searched < exact.searched  # some were certain anyway
    lm_stores = {t for t, s in zip(token, slack) if s < 0}
    assert rough.probe_flipped == len(probes & (kept("rough") ^ lm_stores))
