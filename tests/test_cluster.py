"""A day on a local Dask cluster: its LM pass and its memory's searches on the workers, the memory,
metrics and features equal to the one-process run's; a worker killed mid-day changes nothing."""

import datetime as dt
import os
import shutil
import signal
from collections import Counter

import numpy as np
import pytest

from monim.core.config import EvalConfig

DAYS = ("1987-03-02", "1987-03-02")  # one day: the LM pass is per day
STREAM = ("1987-03-02", "1987-03-03")  # two days: the second one's decisions search the first one's memory
POLICIES = ("fullmem", "monim-amt")
WEEKLY = EvalConfig(period="week", period_docs=2)  # the evaluation suite: each run's PPL as of each day
SMALL_PARTS = 1  # bytes of index a part holds: a part per day (from the second day on)


@pytest.mark.slow
def test_featurizing_on_a_two_worker_cluster_learns_what_one_process_learns(prefect, tiny_model_dir, tmp_path):
    from distributed import LocalCluster

    from flows.stream import learn_stream
    from monim.core.config import DEMO_STREAM
    from monim.core.run_config import RunConfig
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
    from monim.core.config import DEMO_STREAM
    from monim.core.run_config import RunConfig
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

    from monim.core.run_config import RunConfig

    with pytest.raises(ValidationError, match="cluster needs the feature store"):
        RunConfig(cluster="tcp://127.0.0.1:8786", feature_store=False)


def search_parts(scheduler):
    """A Dask scheduler plugin (in the test's process, where a LocalCluster's scheduler runs): the
    workers each search part ran on, by stage ("decision-search": its key's prefix); while `killing`,
    the worker a decision search part is sent to is killed (SIGKILL) before it can answer."""

    from distributed.diagnostics.plugin import SchedulerPlugin

    class SearchParts(SchedulerPlugin):
        name = "monim-search-parts"

        def __init__(self):
            self.ran, self.killing, self.killed = Counter(), False, 0

        def transition(self, key, start, finish, *args, **kwargs):
            stage = str(key).rsplit("-", 1)[0]
            ts = scheduler.tasks.get(key)
            if not stage.endswith("search") or ts is None:
                return
            if finish == "processing" and self.killing and stage == "decision-search":
                os.kill(ts.processing_on.pid, signal.SIGKILL)
                self.killed += 1
            if start == "processing" and finish == "memory":
                for ws in ts.who_has:
                    self.ran[stage, ws.address] += 1

    plugin = SearchParts()
    scheduler.add_plugin(plugin)
    return plugin


def _memory(workdir, policy) -> dict:
    """What a run learned: its memory's checksum, files (helpers.fingerprint: shards byte for byte, Θ by
    content), entries and ids, and its rows' metrics."""
    from helpers import fingerprint
    from monim.core.config import DEMO_STREAM
    from monim.core.run_config import RunConfig
    from monim.run import recorded_days
    from monim.storage.datastore import Datastore

    ds = Datastore.read(root := workdir / "memories" / policy)
    rows = recorded_days(RunConfig(workdir=str(workdir), source=str(DEMO_STREAM), policy=policy))
    return {"checksum": ds.checksum(), "files": fingerprint(root), "entries": len(ds), "ids": ds.shards.array("ids"),
            "rows": sorted(rows), "ppl": [rows[d]["ppl"] for d in sorted(rows)]}


def _same(a: dict, b: dict) -> None:
    """The same memory (its files' contents, entries and ids) and the same PPL (Datastore.checksum differs
    between any two memories: it hashes Θ's random folder names)."""
    assert (b["files"], b["entries"], b["rows"]) == (a["files"], a["entries"], a["rows"])
    np.testing.assert_array_equal(b["ids"], a["ids"])
    assert b["ppl"] == pytest.approx(a["ppl"], rel=1e-6)


@pytest.fixture(scope="module")
def alone(prefect, tiny_model_dir, tmp_path_factory):
    """A function part_bytes -> the work directory of the two-day stream learned in one process by each
    policy (the LM's features in its feature store, which the cluster's runs copy: the same keys), and
    the evaluation suite's weekly PPL of the runs."""
    from flows.evaluate import evaluate_runs
    from flows.stream import learn_stream
    from monim.core.config import DEMO_STREAM
    from monim.core.run_config import RunConfig

    made = {}

    def learn(part_bytes):
        if part_bytes not in made:
            workdir = tmp_path_factory.mktemp(f"alone-{part_bytes}")
            configs = [RunConfig(workdir=str(workdir), source=str(DEMO_STREAM), model=str(tiny_model_dir("llama")),
                                 max_docs=4, policy=policy, part_bytes=part_bytes) for policy in POLICIES]
            for cfg in configs:
                learn_stream(cfg, *STREAM)
            made[part_bytes] = workdir, evaluate_runs(configs, *STREAM, WEEKLY)
        return made[part_bytes]

    return learn


def _spread(alone_dir, tmp_path, part_bytes, cluster, model, policies=POLICIES):
    """Configs of the same runs in a new work directory with the cluster, its feature store the one-process run's."""
    from monim.core.config import DEMO_STREAM
    from monim.core.run_config import RunConfig

    shutil.copytree(alone_dir / "features", tmp_path / "features")
    return [RunConfig(workdir=str(tmp_path), source=str(DEMO_STREAM), model=model, max_docs=4, policy=policy,
                      part_bytes=part_bytes, cluster=cluster) for policy in policies]


@pytest.mark.slow
@pytest.mark.parametrize("part_bytes", [None, SMALL_PARTS], ids=["one-index", "parts"])
def test_a_stream_searched_on_a_two_worker_cluster_learns_what_one_process_learns(prefect, tiny_model_dir, alone,
                                                                                  part_bytes, tmp_path):
    from distributed import LocalCluster
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    from flows.evaluate import evaluate_runs
    from flows.stream import learn_stream

    one, suite = alone(part_bytes)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        parts = search_parts(cluster.scheduler)
        workers = set(cluster.scheduler.workers)
        configs = _spread(one, tmp_path, part_bytes, cluster.scheduler_address, str(tiny_model_dir("llama")))
        for cfg in configs:
            parts.ran.clear()
            learn_stream(cfg, *STREAM)
            _same(_memory(one, cfg.policy), _memory(tmp_path, cfg.policy))
            stages = Counter(stage for stage, _ in parts.ran.elements())
            assert stages["evaluation-search"] >= len(STREAM), stages  # each day's evaluation searched on the cluster
            assert stages["calibration-search"] >= len(STREAM), stages
            assert bool(stages["decision-search"]) == (cfg.policy == "monim-amt"), stages  # FullMem decides nothing
            assert {w for _, w in parts.ran} <= workers  # every search part ran on a worker of the cluster
        parts.ran.clear()
        spread = evaluate_runs(configs, *STREAM, WEEKLY)  # the evaluation suite: each run as of each day
        assert {stage for stage, _ in parts.ran} == {"evaluation-search"}
        assert spread.keys() == suite.keys() == {"periods"}
        for period, runs in suite["periods"].items():
            for name, days in runs.items():
                assert spread["periods"][period][name].keys() == days.keys()
                for day, metrics in days.items():
                    assert spread["periods"][period][name][day]["ppl"] == pytest.approx(metrics["ppl"], rel=1e-6)
    if part_bytes:
        assert len({w for _, w in parts.ran}) == 2  # the memory's parts are searched on both workers
    with get_client(sync_client=True) as client:
        named = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=["decision search"])))
    assert named and all(r.state_name == "Completed" for r in named)  # the Prefect UI shows each search by its stage


@pytest.mark.slow
def test_a_worker_killed_mid_day_leaves_the_memory_as_it_was_and_the_resumed_day_learns_what_one_process_learns(
        prefect, tiny_model_dir, alone, tmp_path):
    """The second day's decision searches lose their worker (killed as each part is sent to it; the
    scheduler gives up on a part at once): the day fails before its commit, the memory is as the first
    day left it; learned again, the day gives the one-process memory."""
    import dask
    from distributed import KilledWorker, LocalCluster

    from flows.stream import learn_stream

    one, _ = alone(None)
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        parts = search_parts(cluster.scheduler)
        (cfg,) = _spread(one, tmp_path, None, cluster.scheduler_address, str(tiny_model_dir("llama")), ["monim-amt"])
        learn_stream(cfg, STREAM[0], STREAM[0])
        before = _memory(tmp_path, "monim-amt")
        parts.killing = True
        with pytest.raises(KilledWorker):
            learn_stream(cfg, *STREAM)
        assert parts.killed >= 1
        after = _memory(tmp_path, "monim-amt")
        assert after["checksum"] == before["checksum"] and after["rows"] == [STREAM[0]]  # nothing of the second day
        _same(before, after)
        parts.killing = False
        learn_stream(cfg, *STREAM)
    _same(_memory(one, "monim-amt"), _memory(tmp_path, "monim-amt"))


def test_each_part_of_a_memory_goes_to_the_same_worker_in_every_search():
    """A part goes to one worker in every search of a day, new parts to the worker holding the fewest;
    the whole index (no part) to any worker; results come back in the items' order."""
    import operator
    from types import SimpleNamespace

    from distributed import LocalCluster

    from tasks.cluster import DaskWorkers

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
        workers = DaskWorkers(cluster.scheduler_address)
        try:
            one, two = sorted(cluster.scheduler.workers)
            asks = [SimpleNamespace(part=p) for p in ("1987-03-04", "1987-03-02", None, "1987-03-03")]
            assert workers.holders(asks) == [one, one, None, two]  # sorted: 03-02 to the first, 03-03, 03-04
            later = [SimpleNamespace(part=p) for p in ("1987-03-05", "1987-03-03")]
            assert workers.holders(later) == [two, two]  # 03-05 new: to the worker holding one part
            assert workers.size == 2
            assert workers.map(operator.attrgetter("part"), asks) == ["1987-03-04", "1987-03-02", None, "1987-03-03"]
        finally:
            workers.close()
