"""The feature store: the same numbers as running the LM, the LM run once per document text, cleanup."""

import datetime as dt

import numpy as np
import pytest

from helpers import learned_memory
from monim.core.config import DEMO_STREAM, ScoreConfig
from monim.data.day import Day
from monim.data.feed import Document, open_feed
from monim.data.stream import iter_days
from monim.evaluation.evaluate import evaluate
from monim.lm.features import Features, gc
from monim.lm.model import load_lm
from monim.storage.index import IndexConfig
from monim.storage.memory_settings import Settings
from monim.theta.calibrator import CalibratorConfig

DAYS = (dt.date(1987, 3, 2), dt.date(1987, 3, 3))
FAST = CalibratorConfig(max_epochs=1, docs_per_day=2, hidden=16, layers=1, embed=8)
CFG = ScoreConfig(stride=48, context=32, batch_size=4)


@pytest.fixture(scope="module")
def days():
    return [Day(d.date, d.train[:3], d.validation, d.test[:2]) for d in iter_days(open_feed(DEMO_STREAM), *DAYS)]


def learn(root, lm, days, features=None, policy="monim-amt"):
    """A memory learned under CFG's window, the LM's features from a store or (None) the LM itself."""
    return learned_memory(root, lm, days, Settings(window=CFG, index=IndexConfig(k=8), calibrator=FAST), policy, features)


def entries(memory):
    """The memory's (doc, position) -> (value, key) pairs, independent of storage order."""
    ds = memory.ds
    out = {}
    for day in ds.days:
        docs, pos = ds.shards.shard(day.shard, "docs"), ds.shards.shard(day.shard, "positions")
        vals, keys = ds.shards.shard(day.shard, "values"), ds.shards.shard(day.shard, "keys")
        names = ds.shards.shard_docs(day.shard)
        for i in range(len(vals)):
            out[(names[docs[i]], int(pos[i]))] = (int(vals[i]), np.asarray(keys[i], np.float32))
    return out


def test_every_consumer_gives_the_same_numbers_from_the_store(tiny, days, tmp_path):
    """Memorizing (MoNIM, whose Θ searches), calibrating and evaluating read the store and give
    what running the LM gives; a second policy over the same days runs the LM on nothing."""
    live = learn(tmp_path / "live", tiny, days)
    store = Features(tiny, CFG, tmp_path / "features")
    stored = learn(tmp_path / "stored", tiny, days, store)
    a, b = entries(live), entries(stored)
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert a[k][0] == b[k][0]
        np.testing.assert_allclose(a[k][1], b[k][1], atol=2e-3)
    assert stored.theta()["lam"] == live.theta()["lam"]
    assert stored.theta()["nll"]["calibrator"] == pytest.approx(live.theta()["nll"]["calibrator"], abs=1e-4)
    test = days[-1].test
    want, got = evaluate(tiny, test, live), evaluate(tiny, test, stored, store)
    assert got["ppl_lm"] == pytest.approx(want["ppl_lm"], rel=1e-5)
    assert got["accuracy_lm"] == want["accuracy_lm"]
    # Θ goes through a calibrator trained on features equal only to float precision (other row packing)
    assert got["ppl"] == pytest.approx(want["ppl"], rel=1e-3)
    assert got["accuracy"] == pytest.approx(want["accuracy"], abs=0.01)
    scored = store.computed
    learn(tmp_path / "fullmem", tiny, days, store, "fullmem")
    evaluate(tiny, test, stored, store)
    assert store.computed == scored  # every document was in the store


def test_a_document_is_scored_once_whatever_its_id_or_list(tiny, tmp_path):
    store = Features(tiny, CFG, tmp_path)
    a = Document("a", DAYS[0], "Oil prices rose on Monday as traders weighed supply cuts.")
    b = Document("b", DAYS[0], "The central bank left its rates unchanged.")
    first = list(store.scores([a, b], "1987-03-02-test"))
    n = store.computed
    assert n == sum(len(x) for x in first)
    again = Document("a-copy", DAYS[1], a.text)
    got = list(Features(tiny, CFG, tmp_path).scores([again], "1987-03-03-test"))  # a new process, same store
    ref = [x for x in first if x.doc_id[0] == "a"] or first
    assert store.computed == n and set(got[0].doc_id) == {"a-copy"}
    rows = ref[0].doc_id == "a"
    np.testing.assert_array_equal(got[0].logp, ref[0].logp[rows])
    assert list(got[0].position) == list(range(1, rows.sum() + 1))
    other = Features(tiny, ScoreConfig(stride=16, context=8), tmp_path)  # other window settings: other features
    list(other.scores([a], "x"))
    assert other.computed > 0


def test_gc_keeps_the_newest_days_and_fits_the_cap(tiny, tmp_path):
    store = Features(tiny, CFG, tmp_path)
    for i, day in enumerate(("1987-03-02", "1987-03-03", "1987-03-04")):
        store.prepare([Document(f"d{i}", DAYS[0], f"Story number {i} about grain exports and shipping.")], f"{day}-train")
    (store.folder / ".tmp-crashed").mkdir()
    out = gc(tmp_path, keep_days=2)
    names = sorted(p.name[:10] for p in store.folder.iterdir())
    assert out["removed"] == 1 and names == ["1987-03-03", "1987-03-04"]
    assert gc(tmp_path, max_bytes=0)["bytes_after"] == 0
    fresh = Features(tiny, CFG, tmp_path)
    list(fresh.scores([Document("d2", DAYS[0], "Story number 2 about grain exports and shipping.")], "again"))
    assert fresh.computed > 0  # its features were deleted: scored again


def test_features_of_another_dtype_or_other_weights_live_in_their_own_folder(tiny_model_dir, tmp_path):
    """A CPU loads fp32 (bf16 is slower there); bf16 features (a GPU's default) never mix with fp32 ones,
    nor features of other weights at the same model path (a checkpoint replaced in place)."""
    import torch

    path = str(tiny_model_dir("llama"))
    fp32, bf16 = load_lm(path), load_lm(path, dtype="bfloat16")
    assert (fp32.dtype, bf16.dtype) == ("float32", "bfloat16")
    assert Features(fp32, CFG, tmp_path).folder != Features(bf16, CFG, tmp_path).folder
    assert Features(load_lm(path), CFG, tmp_path).folder == Features(fp32, CFG, tmp_path).folder
    changed = load_lm(path)
    with torch.no_grad():
        next(changed.model.parameters())[0, 0] += 1.0
    changed.model.name_or_path = ""  # the tensors themselves are hashed, not the unchanged file
    assert changed.weights != fp32.weights
    assert Features(changed, CFG, tmp_path).folder != Features(fp32, CFG, tmp_path).folder
    with pytest.raises(ValueError, match="dtype"):
        load_lm(path, dtype="fp8")
