"""The GPU acceptance benchmark, in one process and under 10 minutes: the bare LM against monim's
featurization, exact kNN search in torch at k = 1024 over 1M and 10M keys, kNN-LM evaluation against
the bare LM, MoNIM-AMT's memorization pass over a paper-sized day, and CPU/GPU parity.

Weights are random (throughput does not depend on them): SmolLM2-135M's shape and Llama-3.2-1B's;
articles are random tokens of Reuters-like lengths (log-normal, median 350 tokens). It imports
torch, transformers and monim's LM, scoring, kNN-LM and exact-search modules only (no FAISS,
Prefect or MLflow: the lent GPU machines have none). Without a GPU it runs the same steps on the
CPU at small sizes (--quick is implied), and parity compares the CPU's bf16 with its fp32.
Usage: python benchmarks/gpu.py [--quick] [--out DIR]   (DIR: $OUT if set, else benchmarks/results)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path
from types import SimpleNamespace

import monim  # noqa: F401  (OMP settings before torch)
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from monim.exact import TorchExact
from monim.knnlm import interpolate, knn_log_weights, knn_target_logprob
from monim.lm import LM
from monim.scoring import Found, ScoreConfig, score_tokens

SHAPES = {  # (config, name)
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                         rope_theta=500000.0, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048),
}
K, LAM, TEMPERATURE = 1024, 0.25, 10.0
SIZES = {"full": dict(keys=(1_000_000, 10_000_000), day=2_400_000, eval_tokens=200_000, feat_tokens=500_000, budget=150),
         "quick": dict(keys=(20_000, 100_000), day=8_000, eval_tokens=4_000, feat_tokens=8_000, budget=60)}


def random_lm(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).to(device, dtype).eval()
    return LM(model, SimpleNamespace(pad_token_id=0), shape)


def articles(n_tokens: int, vocab: int, seed: int = 0) -> list[tuple[str, list[int], int]]:
    """Random-token articles of Reuters-like lengths, n_tokens in all."""
    rng, out, total = np.random.default_rng(seed), [], 0
    while total < n_tokens:
        n = int(np.clip(rng.lognormal(math.log(350), 0.8), 30, 4000))
        out.append((f"a{len(out)}", rng.integers(1, vocab, n).tolist(), 1))
        total += n
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, reps: int = 1) -> float:
    """Best wall time of `reps` calls after a warm-up call."""
    fn()
    best = math.inf
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def bare_tokens_per_s(lm: LM, rows: int, width: int) -> float:
    """The LM body alone over full rows: the physical bound of featurization."""
    ids = torch.randint(1, lm.model.config.vocab_size, (rows, width), device=lm.device)
    with torch.inference_mode():
        seconds = timed(lambda: lm.model.base_model(input_ids=ids), lm.device, reps=3)
    return rows * width / seconds


def featurize_tokens_per_s(lm: LM, n_tokens: int, neighbors=None) -> tuple[float, int]:
    """monim's featurization (keys, log-probs, entropy; with `neighbors`, their search and the LM's
    log P of their values too) over packed articles."""
    seqs = articles(n_tokens, lm.model.config.vocab_size)
    done = [0]

    def run() -> None:
        done[0] = sum(len(b) for b in score_tokens(lm, seqs, ScoreConfig(), neighbors))

    seconds = timed(run, lm.device)
    return done[0] / seconds, done[0]


def random_keys(n: int, d: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """n keys in clusters (as LM keys are), fp16 on a GPU, generated on the device part by part."""
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    centers = torch.randn((1024, d), generator=g, device=device) * 4
    keys = torch.empty((n, d), dtype=dtype, device=device)
    for lo in range(0, n, 1 << 20):
        m = min(1 << 20, n - lo)
        at = torch.randint(0, 1024, (m,), generator=g, device=device)
        keys[lo : lo + m] = (centers[at] + torch.randn((m, d), generator=g, device=device)).to(dtype)
    return keys, torch.arange(n, device=device)


def exact_fp32(keys: torch.Tensor, q: torch.Tensor, k: int, chunk: int = 1 << 18) -> torch.Tensor:
    """The reference: ids of the k nearest keys by fp32 distances (|k|^2 - 2 q.k), chunk by chunk."""
    best_d = torch.full((len(q), 0), math.inf, device=q.device)
    best_i = torch.zeros((len(q), 0), dtype=torch.long, device=q.device)
    for lo in range(0, len(keys), chunk):
        part = keys[lo : lo + chunk].float()
        d = (part**2).sum(1) - 2 * q.float() @ part.T
        top = d.topk(min(k, d.shape[1]), dim=1, largest=False)
        best_d, at = torch.cat([best_d, top.values], 1).topk(k, dim=1, largest=False)
        best_i = torch.cat([best_i, top.indices + lo], 1).gather(1, at)
    return best_i


def knn_search(n: int, d: int, device: torch.device) -> tuple[dict, TorchExact]:
    keys, ids = random_keys(n, d, device)
    queries = (keys[torch.randint(0, n, (4096,), device=device)].float()
               + torch.randn((4096, d), device=device) * 0.5).cpu().numpy()
    truth = exact_fp32(keys, torch.from_numpy(queries[:64]).to(device), K).cpu().numpy()
    index = TorchExact(keys, ids)
    seconds = timed(lambda: index.search(queries, K), device)
    found = index.search(queries[:64], K)[1]
    recall = float(np.mean([np.isin(t, f).mean() for t, f in zip(truth, found)]))
    return {"keys": n, "queries_per_s": len(queries) / seconds, "recall_vs_fp32": recall,
            "gpu_bytes": keys.numel() * keys.element_size()}, index


def memory_neighbors(index: TorchExact, vocab: int, seed: int = 0):
    """A memory's search as monim's LM hook: each entry's value a random token."""
    values = np.random.default_rng(seed).integers(0, vocab, index.ntotal).astype(np.int32)

    def neighbors(batch) -> Found:
        dist, ids = index.search(batch.key.astype(np.float32), K)
        return Found(dist, np.where(ids >= 0, values[ids.clip(min=0)], -1), ids)

    return neighbors


def theta_logp(batch) -> torch.Tensor:
    """Θ's log P of each target (constant λ, T): the interpolation of the kNN-LM."""
    values = torch.from_numpy(batch.knn_values).long()
    logw = knn_log_weights(torch.from_numpy(batch.knn_dist), values, TEMPERATURE)
    return interpolate(torch.from_numpy(batch.logp), knn_target_logprob(logw, values, torch.from_numpy(batch.target).long()), LAM)


def knnlm_tokens_per_s(lm: LM, neighbors, n_tokens: int, budget: float) -> tuple[float, int]:
    """LM + search + interpolation over n_tokens (or what `budget` seconds allow: the rate is measured)."""
    seqs, done, started = articles(n_tokens, lm.model.config.vocab_size, seed=1), 0, time.perf_counter()
    for batch in score_tokens(lm, seqs, ScoreConfig(), neighbors):
        theta_logp(batch)
        done += len(batch)
        if time.perf_counter() - started > budget:
            break
    return done / (time.perf_counter() - started), done


def parity(device: torch.device) -> dict:
    """A tiny model on the CPU (fp32) and in bf16 on `device` (the GPU; without one, the CPU's bf16):
    scores, keys and kNN distributions."""
    seqs = articles(3000, SHAPES["tiny"]["vocab_size"], seed=2)
    out = []
    for where, dtype in (("cpu", torch.float32), (device.type, torch.bfloat16)):
        lm = random_lm("tiny", torch.device(where), dtype)
        batches = list(score_tokens(lm, seqs, ScoreConfig(batch_size=8)))
        key = np.concatenate([b.key for b in batches]).astype(np.float32)
        order = np.lexsort((np.concatenate([b.position for b in batches]), np.concatenate([b.doc_id for b in batches])))
        logp = np.concatenate([b.logp for b in batches])[order]
        index = TorchExact.from_parts([(key[order][:2000], np.arange(2000))], 2000, key.shape[1], where)
        dist, ids = index.search(key[order][2000:2500], 64)
        logw = knn_log_weights(torch.from_numpy(dist), torch.from_numpy(ids), TEMPERATURE).exp().numpy()
        out.append((logp, key[order], ids, logw))
    (lp_c, key_c, ids_c, w_c), (lp_g, key_g, ids_g, w_g) = out
    return {"against": f"{device.type} bf16", "tokens": len(lp_c), "logp_max_abs_diff": float(np.abs(lp_c - lp_g).max()),
            "key_rel_diff": float(np.linalg.norm(key_c - key_g) / np.linalg.norm(key_c)),
            "knn_top64_overlap": float(np.mean([np.isin(a, b).mean() for a, b in zip(ids_c, ids_g)])),
            "knn_weight_max_abs_diff": float(np.abs(np.sort(w_c, 1) - np.sort(w_g, 1)).max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Small sizes (implied without a GPU).")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or Path(__file__).parent / "results"))
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = SIZES["quick" if args.quick or device.type == "cpu" else "full"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = 64 if device.type == "cuda" else 8
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                    "torch": torch.__version__, "dtype": str(dtype), "sizes": size, "lm": [], "knn": []}
    started = time.perf_counter()

    for shape in ("smollm2-135m", "llama-3.2-1b"):
        lm = random_lm(shape, device, dtype)
        bare = bare_tokens_per_s(lm, rows, 1024 if device.type == "cuda" else 256)
        feat, n = featurize_tokens_per_s(lm, size["feat_tokens"] // (1 if shape == "smollm2-135m" else 4))
        report["lm"].append({"model": shape, "bare_tokens_per_s": bare, "featurize_tokens_per_s": feat,
                             "ratio": feat / bare, "tokens": n})
        print(f"{shape}: bare {bare:,.0f} tok/s, featurization {feat:,.0f} tok/s ({feat / bare:.2f}x)", flush=True)
        del lm

    lm = random_lm("smollm2-135m", device, dtype)
    bare = report["lm"][0]["bare_tokens_per_s"]
    for n in size["keys"]:
        row, index = knn_search(n, lm.hidden_size, device)
        rate, done = knnlm_tokens_per_s(lm, memory_neighbors(index, lm.model.config.vocab_size),
                                        size["eval_tokens"], size["budget"] / 4)
        row |= {"knnlm_tokens_per_s": rate, "knnlm_ratio_to_bare": rate / bare, "knnlm_tokens": done}
        print(f"{n:,} keys: {row['queries_per_s']:,.0f} queries/s at k={K}, recall {row['recall_vs_fp32']:.4f}; "
              f"kNN-LM {rate:,.0f} tok/s ({rate / bare:.2f}x the bare LM)", flush=True)
        report["knn"].append(row)
    # MoNIM-AMT's pass over a day: Θ's log P of every training token against the largest memory
    rate, done = knnlm_tokens_per_s(lm, memory_neighbors(index, lm.model.config.vocab_size), size["day"], size["budget"])
    report["memorize"] = {"day_tokens": size["day"], "memory_keys": index.ntotal, "tokens_measured": done,
                          "tokens_per_s": rate, "day_minutes": size["day"] / rate / 60}
    print(f"memorization pass: {rate:,.0f} tok/s over {done:,} tokens: a {size['day']:,}-token day against "
          f"{index.ntotal:,} keys takes {size['day'] / rate / 60:.1f} min", flush=True)
    del index
    report["parity"] = parity(device)
    print(f"parity: {report['parity']}")
    report["seconds"] = time.perf_counter() - started

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-{device.type}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
