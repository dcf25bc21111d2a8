"""Exact kNN search in torch, for a GPU without FAISS's GPU build: the memory's fp16 keys on the
device, candidates by a chunked matmul + top-k, their distances recomputed exactly; and the choice
of where a memory is searched."""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import torch

GPU_SHARE = 0.5  # of the GPU's free memory the keys may take (the rest: the LM, activations, top-k buffers)


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

    @torch.inference_mode()
    def search(self, queries: np.ndarray, k: int, block: int = 256) -> tuple[np.ndarray, np.ndarray]:
        """Squared L2 distances and ids of the k nearest keys (inf and -1 where fewer exist), `block`
        queries at a time (their candidates' keys are gathered: block x k x d floats)."""
        n, kk = len(queries), min(k, self.ntotal)
        out_d, out_i = np.full((n, k), np.inf, np.float32), np.full((n, k), -1, np.int64)
        for i in range(0, n if kk else 0, block):
            q = torch.from_numpy(np.ascontiguousarray(queries[i : i + block], dtype=np.float32)).to(self.device)
            dist, found = self._nearest(q / self.scale, kk)
            out_d[i : i + len(q), :kk], out_i[i : i + len(q), :kk] = dist.cpu().numpy(), self.ids[found].cpu().numpy()
        return out_d, out_i

    @staticmethod
    def _dot(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q . keys as fp32 scores; on a GPU, fp16 products summed straight into fp32 (scores rounded to
        fp16 lost 5.5% of the 1,024 nearest of 10M keys on an H200, and were slower)."""
        if keys.is_cuda and keys.dtype == torch.float16:
            return torch.mm(q, keys.T, out_dtype=torch.float32)
        return (q @ keys.T).float()

    def _nearest(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k nearest rows of scaled queries: candidates by score = 2 q.k - |k|^2 (the larger, the
        nearer) chunk by chunk, then their distances recomputed from the keys in fp32, ascending."""
        best_s = torch.full((len(q), 0), -torch.inf, device=self.device)
        best_i = torch.zeros((len(q), 0), dtype=torch.long, device=self.device)
        qd = q.to(self.keys.dtype)
        for lo in range(0, self.ntotal, self.chunk):
            s = 2 * self._dot(qd, self.keys[lo : lo + self.chunk]) - self.norms[lo : lo + self.chunk]
            top = s.topk(min(k, s.shape[1]), dim=1)
            best_s, at = torch.cat([best_s, top.values], 1).topk(k, dim=1)
            best_i = torch.cat([best_i, top.indices + lo], 1).gather(1, at)
        dist = ((self.keys[best_i].float() - q[:, None, :]) ** 2).sum(-1) * self.scale**2
        dist, order = dist.sort(dim=1)
        return dist, best_i.gather(1, order)
