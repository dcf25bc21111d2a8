"""Evaluation: time travel against memories built only up to that day, one LM pass for many
memories against scoring each separately, periods, and the as-of index search against numpy."""

import datetime as dt

import numpy as np
import pytest

from helpers import learned_memory, nearest_by_numpy
from monim.core.config import DEMO_STREAM, EvalConfig, period_of
from monim.data.feed import open_feed
from monim.data.stream import iter_days
from monim.evaluation.evaluate import evaluate, evaluate_many
from monim.evaluation.suite import period_sets
from monim.evaluation.totals import combine
from monim.learning.memorize import memorize_day
from monim.learning.policies import make_policy
from monim.lm.scoring import score, with_neighbors
from monim.storage.index import IndexConfig, MemoryIndex
from monim.storage.memory_settings import Settings
from monim.theta.calibrator import CalibratorConfig
from monim.theta.memory import Memory

DAYS = (dt.date(1987, 3, 2), dt.date(1987, 3, 3), dt.date(1987, 3, 4))
FAST = CalibratorConfig(max_epochs=1, docs_per_day=2, hidden=16, layers=1, embed=8)


@pytest.fixture(scope="module")
def stream():
    return list(iter_days(open_feed(DEMO_STREAM), DAYS[0], DAYS[-1]))


def learn(root, lm, days):
    """A FullMem memory over the first 2 training articles of each day, calibrated daily."""
    return learned_memory(root, lm, [day.capped(2) for day in days], Settings(index=IndexConfig(k=16), calibrator=FAST))


@pytest.fixture(scope="module")
def memories(tiny, stream, tmp_path_factory):
    whole = learn(tmp_path_factory.mktemp("whole"), tiny, stream)
    first_two = learn(tmp_path_factory.mktemp("two"), tiny, stream[:2])
    return whole, first_two


def test_time_travel_equals_a_memory_that_stopped_that_day(tiny, stream, memories):
    whole, first_two = memories
    past = whole.at(DAYS[1])
    assert len(past) == len(first_two) < len(whole)
    assert past.theta()["date"] == DAYS[1].isoformat() and whole.theta()["date"] == DAYS[2].isoformat()
    assert past.interpolation == first_two.interpolation
    np.testing.assert_array_equal(past.lexical().count, first_two.lexical().count)
    np.testing.assert_array_equal(past.lexical().pairs, first_two.lexical().pairs)
    docs = stream[2].test[:2]
    got, want = evaluate(tiny, docs, past), evaluate(tiny, docs, first_two)
    assert got["tokens"] == want["tokens"] > 0
    assert got["ppl"] == pytest.approx(want["ppl"], rel=1e-4) and got["accuracy"] == pytest.approx(want["accuracy"], abs=2e-3)
    assert evaluate(tiny, docs, whole)["ppl"] != pytest.approx(want["ppl"], rel=1e-4)  # the third day counts
    # the same view through the constructor; before the first day it is empty: Θ is the LM alone
    assert len(Memory.open(whole.ds.root, tiny, DAYS[1])) == len(first_two)
    before = evaluate(tiny, docs, whole.at(dt.date(1987, 3, 1)))
    assert before["ppl"] == pytest.approx(before["ppl_lm"], rel=1e-9)
    with pytest.raises(ValueError, match="read-only"):
        memorize_day(past, stream[2], make_policy("fullmem"))


def test_one_lm_pass_for_many_memories_equals_scoring_each(tiny, stream, memories):
    whole, first_two = memories
    docs = stream[2].test[:2]
    many = evaluate_many(tiny, docs, {"whole": whole, "two": first_two, "lm": None})
    for name, memory in (("whole", whole), ("two", first_two)):
        batches = memory.score(docs)  # the neighbours searched while the LM scores
        logp = np.concatenate([memory.theta_scores(b).logp for b in batches])
        hits = sum(int((memory.theta_scores(b).argmax == b.target).sum()) for b in batches)
        assert many[name]["tokens"] == len(logp)
        assert many[name]["ppl"] == pytest.approx(np.exp(-logp.mean()), rel=1e-5)
        assert many[name]["accuracy"] == pytest.approx(hits / len(logp), abs=2e-3)
    assert many["lm"]["ppl"] == pytest.approx(many["lm"]["ppl_lm"]) == pytest.approx(many["whole"]["ppl_lm"])
    # with_neighbors fills the same fields as searching during scoring
    hooked = whole.score(docs[:1])[0]
    later = with_neighbors(tiny, next(score(tiny, docs[:1], keep_hidden=True)), whole.search)
    np.testing.assert_array_equal(later.knn_values[:, :5], hooked.knn_values[:, :5])
    np.testing.assert_allclose(later.lm_logp_values, hooked.lm_logp_values, atol=1e-4)


def test_as_of_search_equals_numpy_over_the_days_up_to_it(tmp_path, random_datastore):
    ds = random_datastore((200, 300, 200))
    all_keys = ds.shards.array("keys")
    queries = np.random.default_rng(1).standard_normal((9, 8)).astype(np.float32)
    for kind, cfg in (("flat", IndexConfig(k=10)), ("ivfpq", IndexConfig(k=10, exact_below=500, code_bytes=8, nprobe=64))):
        index = MemoryIndex(tmp_path / kind, 8, cfg)
        index.sync(ds)
        assert index.meta["kind"] == kind
        dist, ids = index.search(queries, below=500)
        assert (ids < 500).all() and (ids >= 0).all()
        if kind == "flat":  # exact: the 10 nearest of the first two days' keys
            want_dist, want_ids = nearest_by_numpy(queries, all_keys[:500], 10)
            np.testing.assert_array_equal(np.sort(ids, 1), np.sort(want_ids, 1))
            np.testing.assert_allclose(dist, want_dist, rtol=1e-3)
            few = index.search(queries, below=3)  # fewer entries than k: the rest are missing
            assert (few[1][:, :3] >= 0).all() and (few[1][:, 3:] == -1).all()


def test_periods_and_spread_test_sets():
    assert period_of(dt.date(2022, 6, 1), "month") == "2022-06"
    assert period_of(dt.date(2022, 6, 5), "week") == "2022-W22" and period_of(dt.date(2022, 6, 6), "week") == "2022-W23"
    with pytest.raises(ValueError, match="period must be one of"):
        EvalConfig(period="day")
    sets = period_sets(str(DEMO_STREAM), DAYS[0], dt.date(1987, 3, 10), "week")
    assert list(sets) == ["1987-W10", "1987-W11"]
    days = {d.date for d in sets["1987-W10"]}
    assert min(days) == DAYS[0] and max(days) <= dt.date(1987, 3, 8)
    few = period_sets(str(DEMO_STREAM), DAYS[0], dt.date(1987, 3, 10), "week", max_docs=3)["1987-W10"]
    assert len(few) == 3 and few[0] == sets["1987-W10"][0] and few[-1] == sets["1987-W10"][-1]


def test_combine_is_token_weighted():
    parts = [{"tokens": 10, "ppl": 10.0, "ppl_lm": 20.0, "accuracy": 0.5, "accuracy_lm": 0.4, "skipped": 0.0},
             {"tokens": 30, "ppl": 1000.0, "ppl_lm": 20.0, "accuracy": 0.1, "accuracy_lm": 0.2, "skipped": 1.0}]
    out = combine(parts)
    assert out["tokens"] == 40 and out["ppl"] == pytest.approx(10 ** ((10 * 1 + 30 * 3) / 40))
    assert out["ppl_lm"] == pytest.approx(20.0) and out["accuracy"] == pytest.approx(0.2) and out["skipped"] == 0.75


def test_chunks_searched_at_once_equal_one_by_one_and_overlap(tiny, stream, memories):
    """A spread memory's chunks are searched side by side (with_neighbors' `at_once`): the same
    neighbours and LM log P as one chunk after another, the searches do overlap, and each runs in the
    caller's context (where a stage names its searches)."""
    import threading
    from contextvars import ContextVar

    stage: ContextVar[str] = ContextVar("stage", default="none")

    whole, _ = memories
    batch = next(score(tiny, stream[2].test[:4], keep_hidden=True))
    inside, most, lock = [0], [0], threading.Lock()

    def counted(part):
        assert stage.get() == "evaluation search"
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            threading.Event().wait(0.05)  # long enough for the other thread's call to start
            return whole.search(part)
        finally:
            with lock:
                inside[0] -= 1

    alone = with_neighbors(tiny, batch, whole.search, chunk=64)
    named = stage.set("evaluation search")
    together = with_neighbors(tiny, batch, counted, chunk=64, at_once=3)
    stage.reset(named)
    assert len(batch) > 3 * 64 and most[0] == 3
    for field in ("knn_dist", "knn_values", "knn_ids", "lm_logp_values"):
        np.testing.assert_array_equal(getattr(together, field), getattr(alone, field), err_msg=field)
