"""Exact kNN search in torch, for a GPU without FAISS's GPU build: the memory's fp16 keys on the
device, candidates by a chunked matmul + top-k, their distances recomputed exactly; and the choice
of where a memory is searched."""

from __future__ import annotations

import copy
import math
from typing import Iterable

import numpy as np
import torch

GPU_SHARE = 0.5  # of the GPU's free memory the keys may take (the rest: the LM, activations, top-k buffers)
BLOCK_BYTES = 1 << 31  # a search pass's fp32 scores (queries x chunk) by default
PASSES = 8  # blocks of queries copied to the device in one copy (4 and 16 timed alike on an H200)
TILE = 32  # scores a tile in top_k: ~sqrt(1M / k=1,024), the tiles' top-k and the candidates' alike (16 timed the same)


def values_of(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The value (next token) of each entry id from a table by id (int32); -1 for -1 (tensors on one device)."""
    return table.take(ids.long().clamp(min=0)).masked_fill_(ids < 0, -1).to(torch.int32)


def search_backend(n_keys: int, dim: int, faiss_gpus: int, cuda: bool, free_gpu_bytes: int,
                   share: float = GPU_SHARE) -> str:
    """Where a memory of `n_keys` keys of width `dim` is searched: "faiss-gpu" where FAISS sees a GPU;
    else "torch" (exact, on the GPU) while its fp16 keys fit in `share` of the GPU's free memory;
    else "faiss-cpu" (exact below `exact_below` keys, else IVF-PQ)."""
    if faiss_gpus > 0:
        return "faiss-gpu"
    if cuda and n_keys * dim * 2 <= share * free_gpu_bytes:
        return "torch"
    return "faiss-cpu"


def gpu_free_bytes() -> int:
    """Free memory of the current CUDA device (0 without one)."""
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0


class TorchExact:
    """Exact squared-L2 search over keys held on a device (fp16 on a GPU, fp32 on a CPU), scaled by a
    power of two so that dot products stay in fp16's range."""

    def __init__(self, keys: torch.Tensor, ids: torch.Tensor, chunk: int = 1 << 20):
        self.keys, self.ids, self.chunk = keys, ids, chunk
        self.device = keys.device
        norms = [keys[lo : lo + chunk].float().norm(dim=1).max() for lo in range(0, len(keys), chunk)]
        top = float(torch.stack(norms).max().clamp(min=1e-6)) if norms else 1.0
        self.scale = 2.0 ** math.ceil(math.log2(top))  # a power of two: dividing by it changes no fp16 key's bits
        keys.div_(self.scale)  # |key| <= 1: q.k stays far from fp16's limit
        self.norms = torch.cat([(keys[lo : lo + chunk].float() ** 2).sum(1) for lo in range(0, len(keys), chunk)]
                               or [torch.zeros(0, device=self.device)])

    @classmethod
    def from_parts(cls, parts: Iterable[tuple[np.ndarray, np.ndarray]], n: int, dim: int,
                   device: str | torch.device) -> TorchExact:
        """Keys and their ids uploaded part by part (a memory's keys in float32 may exceed RAM)."""
        device = torch.device(device)
        keys = torch.empty((n, dim), dtype=torch.float16 if device.type == "cuda" else torch.float32, device=device)
        ids = torch.empty(n, dtype=torch.long, device=device)
        at = 0
        for part_keys, part_ids in parts:
            keys[at : at + len(part_keys)] = torch.from_numpy(np.asarray(part_keys)).to(device, keys.dtype)
            ids[at : at + len(part_ids)] = torch.from_numpy(np.asarray(part_ids, np.int64)).to(device)
            at += len(part_keys)
        return cls(keys[:at], ids[:at])

    @property
    def ntotal(self) -> int:
        return len(self.keys)

    def within(self, above: int = 0, below: int | None = None) -> TorchExact:
        """The entries with `above` <= id < `below` searched alone (a memory as of a day, within a maximum
        age): ids grow with the rows (a memory's days in order), so these keys' rows are one slice of
        them, shared, nothing copied; their bounds read once, here."""
        top = torch.iinfo(torch.long).max if below is None else below
        lo, hi = torch.searchsorted(self.ids, torch.tensor([above, top], device=self.device)).tolist()
        if (lo, hi) == (0, self.ntotal):
            return self
        view = copy.copy(self)
        view.keys, view.ids, view.norms = self.keys[lo:hi], self.ids[lo:hi], self.norms[lo:hi]
        return view

    @torch.inference_mode()
    def search(self, queries: np.ndarray, k: int, block: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Squared L2 distances and ids of the k nearest keys (inf and -1 where fewer exist), `block`
        queries at a time: a pass holds block x chunk fp32 scores and gathers its candidates' keys
        (block x k x d floats). By default as many as keep the scores within BLOCK_BYTES, at most 512:
        512 for 1M-key chunks, 2 GiB of scores (on an H200 at k=1,024, 512 gave 20% more queries/s
        than 256 over 1M keys and 7% more over 10M; the matmul is not what bounds a pass, the work
        around it per block is). PASSES blocks of queries go up in one copy, and the results come back
        block by block into pinned memory without waiting, the device waited for once at the end
        (a blocking copy back to pageable memory each block left an H200 idle a third of the time)."""
        if block is None:
            block = max(1, min(512, BLOCK_BYTES // (4 * max(1, min(self.chunk, self.ntotal)))))
        n, kk = len(queries), min(k, self.ntotal)
        pin = self.device.type == "cuda"
        out_d = torch.full((n, k), torch.inf, dtype=torch.float32, pin_memory=pin)
        out_i = torch.full((n, k), -1, dtype=torch.long, pin_memory=pin)
        step = block * PASSES
        for i in range(0, n if kk else 0, step):
            q = torch.from_numpy(np.ascontiguousarray(queries[i : i + step], dtype=np.float32)).to(self.device)
            for j in range(0, len(q), block):
                dist, found = self._nearest(q[j : j + block] / self.scale, kk)
                out_d[i + j : i + j + len(dist), :kk].copy_(dist, non_blocking=True)
                out_i[i + j : i + j + len(dist), :kk].copy_(self.ids[found], non_blocking=True)
        if pin:
            torch.cuda.synchronize(self.device)
        return out_d.numpy(), out_i.numpy()

    @torch.inference_mode()
    def search_on(self, queries: torch.Tensor, k: int, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`search` of queries already on the device, its answers left there (nothing read by the host):
        ascending distances, ties by id (as MemoryIndex's exact head), inf and -1 where fewer exist."""
        if block is None:
            block = max(1, min(512, BLOCK_BYTES // (4 * max(1, min(self.chunk, self.ntotal)))))
        kk = min(k, self.ntotal)
        out_d = torch.full((len(queries), k), torch.inf, dtype=torch.float32, device=self.device)
        out_i = torch.full((len(queries), k), -1, dtype=torch.long, device=self.device)
        for j in range(0, len(queries) if kk else 0, block):
            dist, found = self._nearest(queries[j : j + block].float() / self.scale, kk)
            ids = self.ids[found]
            by_id = ids.argsort(dim=1, stable=True)
            order = dist.gather(1, by_id).argsort(dim=1, stable=True)
            at = by_id.gather(1, order)
            out_d[j : j + len(dist), :kk], out_i[j : j + len(dist), :kk] = dist.gather(1, at), ids.gather(1, at)
        return out_d, out_i

    @staticmethod
    def _scores(q: torch.Tensor, keys: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """q.k - |k|^2 / 2 as fp32 scores, the norms taken off in place (a bias in torch.addmm was a
        copy more, not cuBLAS's epilogue, on an H200); on a GPU, fp16 products summed straight into
        fp32 (scores rounded to fp16 lost 5.5% of the 1,024 nearest of 10M keys on an H200, and were
        slower)."""
        if keys.is_cuda and keys.dtype == torch.float16:
            dot = torch.mm(q, keys.T, out_dtype=torch.float32)
        else:
            dot = (q @ keys.T).float()
        return dot.sub_(norms, alpha=0.5)

    def _nearest(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k nearest rows of scaled queries: candidates by score = q.k - |k|^2 / 2 (the larger, the
        nearer; half of 2 q.k - |k|^2, exactly, in one pass over the scores) chunk by chunk, each
        chunk's k best by `top_k`, then their distances recomputed from the keys in fp32, ascending."""
        best_s = torch.full((len(q), 0), -torch.inf, device=self.device)
        best_i = torch.zeros((len(q), 0), dtype=torch.long, device=self.device)
        qd = q.to(self.keys.dtype)
        for lo in range(0, self.ntotal, self.chunk):
            s = self._scores(qd, self.keys[lo : lo + self.chunk], self.norms[lo : lo + self.chunk])
            top_s, top_i = top_k(s, min(k, s.shape[1]))
            best_s, at = torch.cat([best_s, top_s], 1).topk(k, dim=1)
            best_i = torch.cat([best_i, top_i + lo], 1).gather(1, at)
        dist = torch.sub(self.keys[best_i], q[:, None, :]).pow_(2).sum(-1) * self.scale**2  # fp32, as q is
        dist, order = dist.sort(dim=1)
        return dist, best_i.gather(1, order)


def tiles_pay(n: int, k: int, tile: int | None = None) -> bool:
    """Whether top_k takes a row of n scores in tiles (of TILE by default, read at the call: 0 turns
    tiles off): where its k*tile candidates are at most a quarter of it."""
    tile = TILE if tile is None else tile
    return tile > 1 and k * tile * 4 <= n


def top_k(s: torch.Tensor, k: int, tile: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest scores of each row of s [Q, N] and their columns, in no order; exact. Where the
    k*tile candidates are at most a quarter of the row, in two stages (torch.topk over the whole row
    is what bounds a GPU's search): each tile's maximum, the k tiles with the largest maxima, and the
    top k of their k*tile scores. A tile is `tile` columns N/tile apart (column c in tile c mod N/tile;
    the last N mod tile columns a shorter tile of their own): the maxima are then one elementwise max
    of `tile` contiguous slices, 0.5 ms for 512 x 1M fp32 scores on an H200, where tiles of adjacent
    columns took 4 ms (an amax over a last dimension of 8 to 32). Exact for any tiling: those k tiles
    hold k scores >= the k-th largest tile maximum m, so the k-th largest score v >= m, so every tile
    holding a score >= v has its maximum >= v >= m and is among them (ties at m only swap equal
    scores); and they hold >= (k-1)*tile + 1 >= k real scores."""
    rows, n = s.shape
    tile = TILE if tile is None else tile
    if not tiles_pay(n, k, tile):
        top = s.topk(k, dim=1, sorted=False)
        return top.values, top.indices
    g = n // tile  # tiles of a full `tile` columns; tile g, if any, the tail
    full = g * tile
    maxima = s[:, :full].view(rows, tile, g).amax(1)
    if full < n:
        maxima = torch.cat([maxima, s[:, full:].amax(1, keepdim=True)], 1)
    tiles = maxima.topk(k, dim=1, sorted=False).indices[:, :, None]
    step = torch.arange(tile, device=s.device)
    at = tiles + step * g
    if full < n:  # the tail tile's columns, -inf past the row's end: never among the k
        at = torch.where(tiles == g, full + step, at).view(rows, k * tile)
        cand = s.gather(1, at.clamp(max=n - 1)).masked_fill_(at >= n, -torch.inf)
    else:
        at = at.view(rows, k * tile)
        cand = s.gather(1, at)
    top = cand.topk(k, dim=1, sorted=False)
    return top.values, at.gather(1, top.indices)
