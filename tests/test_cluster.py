"""A day's LM pass on a local Dask cluster: the memory, metrics and features equal the one-process run's."""

import datetime as dt

import numpy as np
import pytest

DAYS = ("1987-03-02", "1987-03-02")  # one day: the LM pass is per day


@pytest.mark.slow
def test_featurizing_on_a_two_worker_cluster_learns_what_one_process_learns(prefect, tiny_model_dir, tmp_path):
    from distributed import LocalCluster

    from flows.stream import learn_stream
    from monim.core.config import DEMO_STREAM, RunConfig
    from monim.storage.datastore import Datastore

    base = dict(source=str(DEMO_STREAM), model=str(tiny_model_dir("llama")), max_docs=6, policy="fullmem")
    alone = learn_stream(RunConfig(workdir=str(tmp_path / "one"), **base), *DAYS)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        spread = learn_stream(RunConfig(workdir=str(tmp_path / "two"), cluster=cluster.scheduler_address, **base), *DAYS)
    assert [r["featurize_workers"] for r in alone] == [1] and [r["featurize_workers"] for r in spread] == [2]
    assert [r["tokens_featurized"] for r in spread] == [r["tokens_featurized"] for r in alone]
    parts = sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "two" / "features").glob(f"*/{DAYS[0]}-train-p*"))
    assert parts == [f"{DAYS[0]}-train-p{i}" for i in range(4)]  # 2 parts per worker
    for a, b in zip(alone, spread):
        assert (b["entries"], b["tokens_seen"]) == (a["entries"], a["tokens_seen"])
        assert b["ppl"] == pytest.approx(a["ppl"], rel=1e-3) and b["ppl_lm"] == pytest.approx(a["ppl_lm"], rel=1e-3)
    one, two = (Datastore.read(tmp_path / w / "memories" / "fullmem") for w in ("one", "two"))
    np.testing.assert_array_equal(two.shards.array("values"), one.shards.array("values"))
    np.testing.assert_array_equal(two.shards.array("positions"), one.shards.array("positions"))
    np.testing.assert_allclose(two.shards.array("keys").astype(np.float32), one.shards.array("keys").astype(np.float32), atol=2e-2)


@pytest.mark.slow
def test_a_worker_with_four_threads_writes_the_features_one_process_writes(prefect, tiny_model_dir, tmp_path):
    """Four threads of one Dask worker share its LM: each part's keys and scores are its own (the key
    is captured per forward pass), equal to what one process writes."""
    from distributed import LocalCluster

    from flows.cluster import featurize_day
    from monim.core.config import DEMO_STREAM, RunConfig
    from monim.data.stream import read_day
    from monim.lm.features import Features
    from monim.lm.model import load_lm
    from monim.run import make_run

    day = read_day(DEMO_STREAM, dt.date(1987, 3, 2)).capped(8)
    base = dict(source=str(DEMO_STREAM), model=str(tiny_model_dir("llama")), max_docs=8, policy="fullmem")
    with LocalCluster(n_workers=1, threads_per_worker=4, processes=True, dashboard_address=None) as cluster:
        spread = RunConfig(workdir=str(tmp_path / "four"), cluster=cluster.scheduler_address, **base)
        featurize_day(make_run(spread), day)
    lm = load_lm(base["model"])
    alone = Features(lm, spread.window(), tmp_path / "one" / "features")
    threads = Features(lm, spread.window(), tmp_path / "four" / "features")
    assert threads.folder.name == alone.folder.name and len(list(threads.folder.glob("*train-p*"))) == 8  # 2 a thread
    for doc in day.train:
        (a,), (b,) = list(alone.scores([doc], "check")), list(threads.scores([doc], "check"))
        assert threads.computed == 0  # every document came from the four threads' folders
        np.testing.assert_allclose(b.key.astype(np.float32), a.key.astype(np.float32), atol=2e-2, err_msg=doc.id)
        np.testing.assert_allclose(b.logp, a.logp, atol=1e-3, err_msg=doc.id)


def test_balanced_parts_put_each_article_on_the_lightest_part():
    from monim.data.feed import Document
    from monim.lm.features import balanced_parts

    docs = [Document(str(n), "1987-03-02", "x" * n) for n in (1, 10, 2, 9, 1)]
    parts = balanced_parts(docs, 2)
    assert [[len(d.text) for d in p] for p in parts] == [[10, 1, 1], [9, 2]]  # sizes 12 and 11
    assert len(balanced_parts(docs[:1], 4)) == 1 and balanced_parts([], 3) == []


def test_a_cluster_needs_the_feature_store():
    from pydantic import ValidationError

    from monim.core.config import RunConfig

    with pytest.raises(ValidationError, match="cluster needs the feature store"):
        RunConfig(cluster="tcp://127.0.0.1:8786", feature_store=False)
