"""Index: FAISS L2 search over the datastore's keys, exact while small, IVF-PQ when large."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import faiss
import numpy as np
import psutil

from monim.core.atomic import checksum, replacing, write_json
from monim.core.config import CalibratorConfig, IndexConfig
from monim.storage.datastore import Datastore
from monim.storage.workdirs import index_bytes

if TYPE_CHECKING:
    import torch

    from monim.storage.torch_search import TorchExact

log = logging.getLogger(__name__)


# sub-vector sizes FAISS's GPU IVF-PQ scans without precomputed tables (others need them)
GPU_SUBDIMS = {1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 28, 32}


def scaled_nlist(n: int, cap: int) -> int:
    """About 4·sqrt(n) lists as a power of two (4096 at 1M keys), with >= 39 keys per list."""
    target = 2 ** round(np.log2(max(4 * np.sqrt(n), 1)))
    return int(max(1, min(cap, target, n // 39)))


def exact_limit(cfg: IndexConfig, searched: int) -> int:
    """Entries below which a memory is searched exactly: `exact_below` for one whose day searches its
    calibration sample alone (CalibratorConfig.sample_tokens queries), fewer in proportion for one
    whose last day's decision also searched `searched` training tokens (MoNIM): an exact day's
    searches cost entries x queries, IVF-PQ's about the queries alone."""
    base = CalibratorConfig.sample_tokens
    return int(cfg.exact_below * base / (base + searched))


def index_kind(cfg: IndexConfig, ds: Datastore, entries: int | None = None) -> str:
    """The index a memory calls for: "ivfpq" from its exact limit on (exact_limit), else "flat"; with
    `entries`, the index of a part of it that holds that many (monim.storage.parts)."""
    days = ds.days
    n = len(ds) if entries is None else entries
    return "ivfpq" if n >= exact_limit(cfg, days[-1].searched if days else 0) else "flat"


def pq_subquantizers(d: int, code_bytes: int) -> int:
    """The largest divisor of d not above code_bytes (PQ needs d divisible by the code size)."""
    return max(m for m in range(1, code_bytes + 1) if d % m == 0)


def backend(cfg: IndexConfig, n_keys: int, dim: int) -> str:
    """Where a memory's full searches run (monim.storage.torch_search.search_backend) unless `gpu` is False: FAISS's
    GPU index, exact torch on the GPU, or FAISS on the CPU."""
    if cfg.gpu is False:
        return "faiss-cpu"
    import torch  # torch where a search runs: a check of the index (fsck, status) reads it without

    from monim.storage.torch_search import gpu_free_bytes, search_backend

    return search_backend(n_keys, dim, faiss.get_num_gpus(), torch.cuda.is_available(), gpu_free_bytes())


def new_ivf(d: int, nlist: int, cfg: IndexConfig) -> faiss.IndexIVF:
    """An untrained IVF index of the config's codec (the constructors, not index_factory, which would
    add slow polysemous training to "pq")."""
    if cfg.codec == "fastscan":
        if d % cfg.fastscan_dims:
            raise ValueError(f"fastscan needs the key size {d} divisible by fastscan_dims={cfg.fastscan_dims}")
        return faiss.IndexIVFPQFastScan(faiss.IndexFlatL2(d), d, nlist, d // cfg.fastscan_dims, 4)
    return faiss.IndexIVFPQ(faiss.IndexFlatL2(d), d, nlist, pq_subquantizers(d, cfg.code_bytes), 8)


def indexed_ids(index: faiss.Index) -> np.ndarray:
    """All ids an IndexIDMap2 or IndexIVF holds."""
    if isinstance(index, faiss.IndexIDMap2):
        return faiss.vector_to_array(index.id_map).astype(np.int64)
    ivf = faiss.extract_index_ivf(index)
    lists = ivf.invlists
    assert lists is not None  # an IVF index holds its lists (FAISS's stubs allow one without)
    parts = [faiss.rev_swig_ptr(lists.get_ids(i), lists.list_size(i)).copy() for i in range(ivf.nlist) if lists.list_size(i)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def free_ram() -> int:
    """Bytes of RAM available now, the page cache included."""
    return psutil.virtual_memory().available


def gpu_precomputed(index: faiss.Index, d: int) -> bool:
    """Whether FAISS's GPU IVF-PQ needs precomputed tables for this index: its sub-vector size has
    no GPU kernel otherwise (576 / 64 = 9 dims)."""
    found = faiss.try_extract_index_ivf(index)
    ivf = faiss.downcast_index(found) if found is not None else None
    return isinstance(ivf, faiss.IndexIVFPQ) and d // ivf.pq.M not in GPU_SUBDIMS


def ivf_params(sel: faiss.IDSelector | None, nprobe: int) -> faiss.SearchParametersIVF:
    """Search parameters of an IVF index: the entries it may find (None: all) and the lists it probes."""
    params = faiss.SearchParametersIVF()
    params.sel, params.nprobe = sel, nprobe  # FAISS keeps `sel` referenced from `params`
    return params


def gpu_options(index: faiss.Index, d: int) -> faiss.GpuClonerOptions:
    """How an index goes to the GPU: float16 lookup tables (`useFloat16`, which the cloner passes
    on as IVF-PQ's useFloat16LookupTables: 64-byte codes exceed shared memory in fp32),
    precomputed tables where needed."""
    options = faiss.GpuClonerOptions()
    options.useFloat16 = True
    options.usePrecomputed = gpu_precomputed(index, d)
    return options


class MemoryIndex:
    """The datastore's FAISS index, versioned with the datastore. An IVF-PQ index is kept in
    `<memory>/index/` (its codes are a few bytes an entry); an exact index is built in RAM from the
    shards' fp16 keys when opened and never written (on disk it would hold every key a second time)."""

    def __init__(self, root: Path | str, hidden_size: int, cfg: IndexConfig | None = None):
        self.dir = Path(root) / "index"
        self.d = hidden_size
        self.cfg = cfg or IndexConfig()
        self.meta: dict = {}
        self.index: faiss.Index | None = None
        self.mapped = False  # the lists are read from disk as searched (a large "pq" index): read-only
        self.obsolete = False  # an exact index a monim before 0.2 wrote to disk: removed by the next save
        self._search_index: faiss.Index | TorchExact | None = None
        self._exact: tuple[tuple, TorchExact] | None = None  # every key on a device (exact_on), by the datastore's state
        self._exact_lock = threading.Lock()
        self._ds: Datastore | None = None  # the datastore last synced to: an exact torch search reads its keys
        self._load(mappable=True)

    def _load(self, mappable: bool) -> None:
        """Read the index and its meta (a large "pq" index mapped from disk if `mappable`); an
        unreadable one is rebuilt from the keys on disk, one from two saves is synced by ids."""
        meta_path, index_path = self.dir / "meta.json", self.dir / "index.faiss"
        self.index, self.meta, self.mapped, self._search_index = None, {}, False, None
        if not (meta_path.exists() and index_path.exists()):
            return
        try:
            self.meta = json.loads(meta_path.read_text())
            if self.meta.get("kind") == "flat":
                self.meta, self.obsolete = {}, True
                return
            self.mapped = (mappable and self.meta.get("codec", "pq") == "pq" and self.meta.get("kind") == "ivfpq"
                           and index_path.stat().st_size > self.cfg.map_above * free_ram())
            self.index = faiss.read_index(str(index_path), faiss.IO_FLAG_MMAP if self.mapped else 0)
        except (RuntimeError, ValueError) as e:
            log.warning("rebuilding unreadable index %s: %s", index_path, e)
            self.index, self.meta, self.mapped = None, {}, False
        if self.index is not None and self.meta.get("ntotal", self.index.ntotal) != self.index.ntotal:
            self.meta.pop("version")  # the files are from two saves (read while a writer saved): sync by ids

    @property
    def ntotal(self) -> int:
        return 0 if self.index is None else self.index.ntotal

    def bytes_on_disk(self) -> int:
        return index_bytes(self.dir.parent)

    def current(self, ds: Datastore) -> bool:
        """Whether the index holds the datastore's committed version."""
        return self.index is not None and self.meta.get("version") == ds.version

    def sync(self, ds: Datastore, retrain: bool = False, save: bool = True, kind: str | None = None) -> dict:
        """Bring the index up to the datastore's committed version: add, remove, or rebuild (and save).
        An IVF index is rebuilt when the memory has grown `retrain_growth` times since training or
        when the probe's recall has fallen below `min_recall` of its recall at training. `kind`: the
        index wanted (None: the one `ds` calls for, index_kind)."""
        started = time.perf_counter()
        stats: dict[str, float | bool | None] = {"added": 0, "removed": 0, "rebuilt": False}
        if self.current(ds) and not retrain:
            self._ds = ds
            return stats | {"seconds": 0.0}
        if self.mapped:  # mapped lists cannot change: read them into RAM
            self._load(mappable=False)
        n = len(ds)
        kind = kind or index_kind(self.cfg, ds)
        stale = (
            retrain
            or self.meta.get("kind") == "flat" and kind == "ivfpq"
            or self.meta.get("kind") == "ivfpq" and n >= self.cfg.retrain_growth * self.meta["trained_on"]
            or self.meta.get("kind") == "ivfpq" == kind and self.meta.get("codec", "pq") != self.cfg.codec
        )
        if self.index is None or stale:
            self._build(ds, kind)
            stats.update(added=n, rebuilt=True)
        else:
            have, want = indexed_ids(self.index), ds.shards.array("ids")
            gone, new = np.setdiff1d(have, want), np.setdiff1d(want, have)
            if len(gone):
                self.index.remove_ids(faiss.IDSelectorBatch(gone))
                self._search_index = None
            self._add_ids(ds, new)
            stats.update(added=len(new), removed=len(gone))
            if len(new) and "recall_at_train" in self.meta:
                stats["recall"] = self.meta["recall"] = recall = self.probe_recall(ds)
                if recall is not None and recall < self.cfg.min_recall * self.meta["recall_at_train"]:
                    log.info("retraining %s: probe recall %.3f < %.2f x %.3f at training", self.dir, recall,
                             self.cfg.min_recall, self.meta["recall_at_train"])
                    self._build(ds, kind)
                    stats.update(added=n, rebuilt=True)
        self.meta |= {"version": ds.version, "ntotal": self.ntotal}
        self._ds, self._search_index = ds, None
        if self._exact is not None and self._exact[0][0] != ds.state:
            self._exact = None  # the old keys let go now, not when next searched
        if save:
            self._save()
        return stats | {"seconds": time.perf_counter() - started}

    def drop(self) -> None:
        """Let the index go, its folder too: the memory is searched in parts (monim.storage.parts)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self.index, self.meta, self.mapped, self._search_index = None, {}, False, None

    def _save(self) -> None:
        """Write an IVF-PQ index (and its meta) aside and rename it into place; an exact one is not
        written, and the files of an older one go."""
        if self.meta.get("kind") != "ivfpq":
            for name in ("index.faiss", "meta.json"):
                (self.dir / name).unlink(missing_ok=True)
            self.obsolete = False
            return
        assert self.index is not None  # an IVF-PQ memory's meta is written with its index (sync)
        with replacing(self.dir / "index.faiss") as tmp:
            faiss.write_index(self.index, str(tmp))
            self.meta["sha256"] = checksum(tmp)  # monim fsck finds a damaged file by it
        write_json(self.dir / "meta.json", self.meta)

    def probe_recall(self, ds: Datastore) -> float | None:
        """The share of the newest `probe` entries' 10 nearest entries (exact, among `probe_pool`
        others sampled) that the index finds among the same pool, searched as deep into the pool as a
        search for k reached into the memory when the index was trained (k x pool / entries, at least
        10; kept, so that growth alone moves nothing): it falls when new keys are encoded badly
        (drift). None for a flat index or a memory too small to probe."""
        ids, p = ds.shards.array("ids"), self.cfg.probe
        n_pool = min(self.cfg.probe_pool, len(ids) - p)
        if self.meta.get("kind") != "ivfpq" or self.index is None or not p or n_pool < 10 * p:
            return None
        pool = np.sort(np.random.default_rng(0).choice(ids[:-p], n_pool, replace=False))
        queries = ds.shards.keys_of(ids[-p:])
        truth = pool[faiss.knn(queries, ds.shards.keys_of(pool), 10)[1]]
        selector = faiss.IDSelectorBatch(pool)
        depth = self.meta.setdefault("probe_depth", max(10, -(-self.cfg.k * n_pool // len(ids))))
        found = self.index.search(queries, depth, params=ivf_params(selector, self.cfg.nprobe))[1]
        return float(np.mean([np.isin(t, f).mean() for t, f in zip(truth, found)]))

    def _build(self, ds: Datastore, kind: str) -> None:
        n = len(ds)
        if kind == "flat":
            self.index = faiss.IndexIDMap2(faiss.IndexFlatL2(self.d))
            self.meta = {"kind": "flat", "trained_on": 0}
        else:
            nlist = scaled_nlist(n, self.cfg.max_nlist)
            index = new_ivf(self.d, nlist, self.cfg)
            ids = ds.shards.array("ids")
            sample = np.sort(np.random.default_rng(0).choice(ids, size=min(n, self.cfg.train_sample), replace=False))
            index.train(ds.shards.keys_of(sample))  # the sampled rows only: a large memory's keys exceed RAM
            self.index = index
            self.meta = {"kind": "ivfpq", "codec": self.cfg.codec, "trained_on": n, "nlist": nlist}
        self._add_ids(ds, ds.shards.array("ids"))
        if kind == "ivfpq":
            recall = self.probe_recall(ds)
            if recall is not None:
                self.meta["recall_at_train"] = self.meta["recall"] = recall

    def _add_ids(self, ds: Datastore, ids: np.ndarray) -> None:
        """Add the entries with these ids, reading their keys shard by shard."""
        assert self.index is not None  # built or read before entries are added (sync, _build)
        for keys, part_ids in self.key_parts(ds, ids):
            self.index.add_with_ids(np.asarray(keys, dtype=np.float32), part_ids)
        self._search_index = None

    @staticmethod
    def key_parts(ds: Datastore, ids: np.ndarray, rows: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The keys (fp16, as stored) and ids of these entries, shard by shard, `rows` at a time."""
        for day in ds.days if len(ids) else ():
            shard_ids = np.asarray(ds.shards.shard(day.shard, "ids"))
            at = np.flatnonzero(np.isin(shard_ids, ids))
            for i in range(0, len(at), rows):
                part = at[i : i + rows]
                yield ds.shards.shard(day.shard, "keys")[part], shard_ids[part]

    def _searcher(self, index: faiss.Index) -> faiss.Index | TorchExact:
        """The index to search (`index`, this memory's): on a GPU, FAISS's copy of it (float16 lookup
        tables; not a fast-scan index, nor one larger than the GPU's memory) or, without FAISS's GPU
        build, every key exact in torch while they fit; else the index itself."""
        if self._search_index is None:
            where = backend(self.cfg, self.ntotal, self.d)
            if where == "torch" and self._ds is not None:
                self._search_index = self.exact_on(self._ds, "cuda")
                return self._search_index
            searched = index
            if where == "faiss-gpu" and self.meta.get("codec") != "fastscan":
                try:
                    searched = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index, gpu_options(index, self.d))
                except RuntimeError as e:
                    log.warning("searching %s on the CPU: %s", self.dir, e)
            if self.meta.get("kind") == "ivfpq":  # a GPU copy is no IndexIVF, but has nprobe itself
                # FAISS's stubs type the copy as a bare GpuIndex; it is the GPU IVF index the cloner made
                (faiss.try_extract_index_ivf(searched) or searched).nprobe = self.cfg.nprobe  # type: ignore[attr-defined]
            self._search_index = searched
        return self._search_index

    def exact_on(self, ds: Datastore, device: str | torch.device) -> TorchExact:
        """Every entry's key held on `device` for exact search (TorchExact), copied up once per state of
        the datastore and shared: this index's own searches on a GPU (`_searcher`) and Θ's on the LM's
        device (Memory.on_device, its views and variants) read the one copy."""
        import torch

        from monim.storage.torch_search import TorchExact

        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        state = (ds.state, device)
        with self._exact_lock:  # one copy made at a time (the index's searches and Θ's, from several threads)
            if self._exact is None or self._exact[0] != state:
                self._exact = None  # the old copy let go before the new one is made
                self._exact = (state, TorchExact.from_parts(self.key_parts(ds, ds.shards.array("ids")), len(ds), self.d, device))
            return self._exact[1]

    def _search_subset(self, index: faiss.Index, q: np.ndarray, k: int, above: int, below: int | None,
                       exclude: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Search only the entries of `index` (this memory's) with `above` <= id < `below` (time travel;
        recency) and not in `exclude` (an article's own entries): exactly over those keys, read in
        place from the flat index, or in the IVF-PQ index with an id selector."""
        if not isinstance(index, faiss.IndexIDMap2):  # IVF-PQ
            # every selector stays referenced here: the C++ ones hold raw pointers to each other
            banned = faiss.IDSelectorBatch(exclude) if exclude is not None else None
            allowed = faiss.IDSelectorNot(banned) if banned is not None else None
            windowed = above > 0 or below is not None
            window = faiss.IDSelectorRange(above, below if below is not None else 1 << 62) if windowed else None
            both = faiss.IDSelectorAnd(window, allowed) if window is not None and allowed is not None else None
            return index.search(q, k, params=ivf_params(both or window or allowed, self.cfg.nprobe))
        ids = faiss.vector_to_array(index.id_map)
        flat = faiss.downcast_index(index.index)
        assert isinstance(flat, faiss.IndexFlat)  # an exact index maps ids to a flat one (_build)
        xb = faiss.rev_swig_ptr(flat.get_xb(), index.ntotal * self.d).reshape(-1, self.d)
        keep = (ids >= above) & (ids < (below if below is not None else np.iinfo(np.int64).max))
        if exclude is not None:
            keep &= ~np.isin(ids, exclude)
        # ids grow with the days: the first run of kept rows is searched in place (a view), only the
        # kept rows after it are copied (an article's own entries are among the last)
        lo = int(np.argmax(keep)) if keep.any() else len(keep)
        hi = lo + (int(np.argmin(keep[lo:])) if not keep[lo:].all() else len(keep) - lo)
        rest = hi + np.flatnonzero(keep[hi:])
        parts = [(xb[lo:hi], ids[lo:hi])] * (hi > lo) + [(xb[rest], ids[rest])] * (len(rest) > 0)
        out_d, out_i = np.full((len(q), k), np.inf, np.float32), np.full((len(q), k), -1, np.int64)
        if not parts:
            return out_d, out_i
        found = [faiss.knn(q, keys, min(k, len(keys))) for keys, _ in parts]
        dist = np.concatenate([d for d, _ in found], axis=1)
        at = np.concatenate([np.where(i >= 0, part_ids[i.clip(min=0)], -1) for (_, part_ids), (_, i) in zip(parts, found)], axis=1)
        order = np.argsort(dist, axis=1, kind="stable")[:, :k]
        n = order.shape[1]
        out_d[:, :n], out_i[:, :n] = np.take_along_axis(dist, order, 1), np.take_along_axis(at, order, 1)
        return out_d, out_i

    def search(self, queries: np.ndarray, k: int | None = None, below: int | None = None,
               exclude: np.ndarray | None = None, above: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Squared L2 distances and entry ids of the k nearest keys (id -1 where fewer exist);
        only among the entries with `above` <= id < `below` (where given); never the ids in `exclude`."""
        k = k or self.cfg.k
        n = len(queries)
        index = self.index
        if index is None or index.ntotal == 0:
            return np.full((n, k), np.inf, np.float32), np.full((n, k), -1, np.int64)
        dist, ids = np.empty((n, k), np.float32), np.empty((n, k), np.int64)
        subset = above > 0 or below is not None or exclude is not None
        for i in range(0, n, self.cfg.query_batch):
            q = np.ascontiguousarray(queries[i : i + self.cfg.query_batch], dtype=np.float32)
            found = self._search_subset(index, q, k, above, below, exclude) if subset else self._searcher(index).search(q, k)
            dist[i : i + len(q)], ids[i : i + len(q)] = found
        return dist, ids
