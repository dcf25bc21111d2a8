"""The GPU acceptance benchmark: kNN-LM scoring with and without the skip, Θ decoding, featurization, kNN, a day.

The GPU acceptance benchmark of issue 70, in one process and under 8 minutes, each rate beside the bare LM
on the same card and shapes: kNN-LM scoring through the device path (score_tokens with a DeviceTheta: the
memory's keys, search, skip and Θ on the LM's device, one host read a pass) at 1M and 10M keys, without and
with the skip (a calibrator trained on the memory, its threshold at the median λ: about half the tokens
skip), and the PPL change the skip causes, beside the host hook's path; Θ's greedy decoding at batch 1
and 16 by the served model's Decoder (monim.serving.generate) against the bare LM's by the same Decoder;
featurization (monim.lm.scoring's passes) against the LM body; exact kNN search in torch at k = 1024 (the
tiled top-k against plain torch.topk, both against fp32 distances); a paper-sized day of MoNIM-AMT
through every stage (featurize + decide, commit, calibrate, evaluate); CPU/GPU parity. Host reads are
counted (monim.lm.host.reads: a pass, a decoding step) and, on a GPU, each timed device section runs
under torch.cuda's sync debug mode (--syncs warn: every unplanned sync listed by its place; error:
it stops the section), the planned reads allowed (monim.lm.host.planned).

Weights are random (throughput does not depend on them): SmolLM2-135M's shape and Llama-3.2-1B's;
articles are random tokens of Reuters-like lengths (log-normal, median 350 tokens); a text is its token
ids (Ids). Which tokens the decision must search depends on a real LM, so each token takes the LM statistics (log p, max log p)
of a real RealTime QA token, in order, from `benchmarks/data/lm-stats-realtimeqa.npz` (tools/lm_stats.py). It imports
torch, transformers and monim's modules that need neither FAISS, Prefect nor MLflow (the lent GPU
machines have none). Without a GPU it runs the same steps on the CPU at small sizes (--quick is
implied: a dry run, not a measurement; --tiny: the tiny model, the tests'), and parity compares the
CPU's bf16 with its fp32. The report is rewritten after each section, so a run stopped early keeps what
it measured. Sections, in the order they run, with their GPU time estimated from the H200 run of
2026-11-27 (187 s in all; docs/results/gpu.md):

    section          what                                                       est. s (H200)
    (start)          imports, CUDA, SmolLM2 built, its bare rate                  15
    knn-1000000      keys, search rates; kNN-LM host hook (capped at 12 s),       35-45
                     calibrator (16k tokens), device and skip rows (<= 12 s each)
    decode           batch 1 and 16, bare and Θ, 128 new tokens (warm-up + run)   10-25
    featurize        SmolLM2 500k tokens, Llama-3.2-1B built + bare + 125k        20
    knn-10000000     as knn-1000000 over 10M keys (search-bound rows capped)      50-60
    day              the paper-sized day: <= 120 s budget, then commit/calibrate  135
    parity           the tiny model, CPU fp32 against GPU bf16                    5
                                                                         total  ~270-300 (deadline 420)

Usage: monim bench gpu [--quick|--tiny] [--sections knn,decode,...] [--syncs warn|error] [--out FILE]
(FILE: $OUT/gpu.json if $OUT is set, else docs/results/gpu/gpu.json); on a machine without typer: python -m benchmarks.gpu
"""

from __future__ import annotations

import math
import os
import platform
import tempfile
import time
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

from benchmarks.harness import parser, save
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from monim.storage import torch_search as exact
from monim.core.atomic import replacing
from monim.theta.calibrator import Calibrator, CalibratorConfig, examples, train_calibrator
from monim.storage.torch_search import TorchExact
from monim.theta.device import DeviceTables, DeviceTheta
from monim.theta.knnlm import (Interpolation, interpolate, knn_log_weights, knn_logprobs_by_temperature, knn_target_logprob,
                         theta_scores)
from monim.storage.lexical import LexicalCounts
from monim.lm import host
from monim.lm.model import LM
from monim.core.config import ScoreConfig
from monim.lm.scoring import score_tokens
from monim.lm.token_scores import Found, TokenScores
from monim.serving.generate import Decoder
from monim.serving.generation import GenerateConfig
from monim.learning.threshold import amt_threshold, certain

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
K, K_DECIDE, LAM, TEMPERATURE, DELTA = 1024, 128, 0.25, 10.0, -1.5  # k, the decision's k (IndexConfig's), Θ's λ, T, δ
SIZES = {  # shapes: the LMs (the first scores and decodes); queries: of the search rates; prompt, new: decoding's tokens
    "full": dict(shapes=("smollm2-135m", "llama-3.2-1b"), keys=(1_000_000, 10_000_000), queries=4096, day=2_400_000,
                 eval_tokens=240_000, feat_tokens=500_000, budget=120, sample=16384, prompt=64, new=128, deadline=420),
    "quick": dict(shapes=("smollm2-135m", "llama-3.2-1b"), keys=(20_000, 100_000), queries=256, day=8_000,
                  eval_tokens=2_000, feat_tokens=4_000, budget=30, sample=1024, prompt=32, new=8, deadline=900),
    "tiny": dict(shapes=("tiny",), keys=(2_000, 5_000), queries=256, day=2_000, eval_tokens=1_000, feat_tokens=2_000,
                 budget=30, sample=512, prompt=16, new=6, deadline=600)}
DECODE_ROWS = (1, 16)
SECTIONS = ("knn", "decode", "featurize", "day", "parity")  # in the order they run (knn: at each memory size)
STATS = Path(__file__).parent / "data" / "lm-stats-realtimeqa.npz"


class Ids:
    """The random LM's tokenizer: a text is its token ids written out ("5 17 3"), and so is a token's text."""

    pad_token_id, eos_token_id = 0, None  # no end of text: a continuation runs its max_new_tokens

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [int(t) for t in text.split()]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f" {int(i)}" for i in ids)


def random_lm(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LM:
    torch.manual_seed(seed)
    with device:  # initialized where it runs (a 1B model's init on the host takes longer than its benchmark)
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).to(dtype).eval()
    return LM(model, Ids(), shape)  # type: ignore[arg-type]


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


@contextmanager
def counting_passes(lm: LM):
    """Count the LM's forward passes (the plan's) while the block runs."""
    count, forward = [0], lm.forward
    lm.forward = lambda *args, **kwargs: (count.__setitem__(0, count[0] + 1), forward(*args, **kwargs))[1]
    try:
        yield count
    finally:
        del lm.forward


@contextmanager
def no_syncs(device: torch.device, mode: str, found: list[str]):
    """torch.cuda's sync debug mode while the block runs on a GPU (nothing on the CPU, where `host.reads`
    counts instead): each operation that makes the host wait for the device, but the planned reads
    (monim.lm.host), is listed in `found` by its place ("warn"), or raises there ("error")."""
    if device.type != "cuda":
        yield
        return
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
            found += [f"{Path(w.filename).name}:{w.lineno}" for w in seen if "synchronizing" in str(w.message)]


def syncs(found: list[str], device: torch.device) -> dict | None:
    """The unplanned syncs `no_syncs` saw: how many, and the places of the most (None: not checked, no GPU)."""
    return {"count": len(found), "places": dict(Counter(found).most_common(5))} if device.type == "cuda" else None


def reads_per_pass(lm: LM, seqs: list, hook=None) -> dict:
    """The host reads score_tokens makes per forward pass (monim.lm.host.reads: each kind counted), once
    the skip's rows are sized to these tokens (DeviceTheta.rows: a pass keeping more than it expects reads again)."""
    for _ in score_tokens(lm, seqs, ScoreConfig(), hook) if isinstance(hook, DeviceTheta) and hook.skip else ():
        pass
    with counting_passes(lm) as passes, host.reads() as counted:
        for _ in score_tokens(lm, seqs, ScoreConfig(), hook):
            pass
    total = sum(counted.values())
    return {"passes": passes[0], "reads": total, "per_pass": total / max(1, passes[0]), "by_kind": dict(counted)}


def bare_tokens_per_s(lm: LM, rows: int, width: int) -> float:
    """The LM body alone over full rows: the physical bound of featurization."""
    ids = torch.randint(1, lm.model.config.vocab_size, (rows, width), device=lm.device)
    with torch.inference_mode():
        seconds = timed(lambda: lm.model.base_model(input_ids=ids), lm.device, reps=3)
    return rows * width / seconds


def featurize(lm: LM, n_tokens: int, mode: str = "warn") -> dict:
    """monim's featurization (keys, log-probs, entropy: monim.lm.scoring's passes) over packed articles: rate,
    passes, tokens per pass, the host reads a pass makes (counted on a tenth of the articles) and unplanned syncs."""
    seqs = articles(n_tokens, lm.model.config.vocab_size)
    done, found = [0], []

    def run() -> None:
        done[0] = sum(len(b) for b in score_tokens(lm, seqs))

    with counting_passes(lm) as passes, no_syncs(lm.device, mode, found):
        seconds = timed(run, lm.device)
    return {"tokens_per_s": done[0] / seconds, "tokens": done[0], "passes": passes[0] // 2,
            "tokens_per_pass": done[0] / max(1, passes[0] // 2),
            "host_reads": reads_per_pass(lm, articles(n_tokens // 10, lm.model.config.vocab_size)),
            "unplanned_syncs": syncs(found, lm.device)}


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


@contextmanager
def plain_topk():
    """TorchExact without its tiled top-k (today's torch.topk over whole chunks), for comparison."""
    tile = exact.TILE
    exact.TILE = 0
    try:
        yield
    finally:
        exact.TILE = tile


def knn_search(n: int, d: int, device: torch.device, n_queries: int = 4096) -> tuple[dict, TorchExact]:
    """Queries/s and recall against fp32 distances, tiled top-k and plain torch.topk."""
    keys, ids = random_keys(n, d, device)
    queries = (keys[torch.randint(0, n, (n_queries,), device=device)].float()
               + torch.randn((n_queries, d), device=device) * 0.5).cpu().numpy()
    truth = exact_fp32(keys, torch.from_numpy(queries[:64]).to(device), K).cpu().numpy()
    index = TorchExact(keys, ids)
    row: dict = {"keys": n, "gpu_bytes": keys.numel() * keys.element_size()}
    for name, mode in (("tiled", nullcontext), ("plain_topk", plain_topk)):
        with mode():
            seconds = timed(lambda: index.search(queries, K), device)
            found = index.search(queries[:64], K)[1]
            k_decide = len(queries) / timed(lambda: index.search(queries, K_DECIDE), device)
        row[name] = {"queries_per_s": len(queries) / seconds, "queries_per_s_k_decide": k_decide,
                     "recall_vs_fp32": float(np.mean([np.isin(t, f).mean() for t, f in zip(truth, found)]))}
    row["speedup"] = row["tiled"]["queries_per_s"] / row["plain_topk"]["queries_per_s"]
    return row, index


def memory_values(index: TorchExact, vocab: int, seed: int = 0) -> np.ndarray:
    """Each entry's value: a random token."""
    return np.random.default_rng(seed).integers(0, vocab, index.ntotal).astype(np.int32)


def memory_neighbors(index: TorchExact, values: np.ndarray, k: int = K):
    """A memory's search as monim's LM hook."""

    def neighbors(batch) -> Found:
        dist, ids = index.search(batch.key.astype(np.float32), k)
        return Found(dist, np.where(ids >= 0, values[ids.clip(min=0)], -1), ids)

    return neighbors


def memory_on_device(index: TorchExact, values: np.ndarray, calibrator: Calibrator | None = None,
                     threshold: float | None = None, k: int = K) -> DeviceTheta:
    """The same memory read by Θ on the LM's device (monim.theta.device), the one place a DeviceTheta is
    made here: constant λ and T, the host reading each pass's Θ scores once (not the neighbours); given a
    calibrator, the skip: tokens whose calibrator λ is below `threshold` keep the LM alone."""
    tables = DeviceTables(index, torch.from_numpy(values).to(index.device), lexical=LexicalCounts.empty)
    return DeviceTheta(tables, k, CalibratorConfig(skip_threshold=threshold), "constant", Interpolation(LAM, TEMPERATURE),
                       LAM, calibrator, skip=calibrator is not None, neighbors=False)


def calibrated(index: TorchExact, values: np.ndarray, batch: TokenScores) -> tuple[Calibrator, np.ndarray]:
    """A calibrator trained as a day's calibration on a scored sample searched in the memory, and its λ of each token."""
    batch.knn_dist, batch.knn_values, batch.knn_ids, _, _ = memory_neighbors(index, values)(batch)
    ex = examples(batch, LexicalCounts.empty(), knn_logprobs_by_temperature(batch),
                  holdout=np.arange(len(batch)) % 4 == 0)
    calibrator = train_calibrator(ex, CalibratorConfig(), LAM, TEMPERATURE)
    return calibrator, calibrator.lam(ex)


def sample(lm: LM, n_tokens: int, seed: int) -> TokenScores:
    """n_tokens of random articles scored by the LM."""
    return TokenScores.concat(list(score_tokens(lm, articles(n_tokens, lm.model.config.vocab_size, seed))))


def theta_logp(batch, device: torch.device) -> torch.Tensor:
    """Θ's log P of each target (constant λ, T): the interpolation of the kNN-LM, on `device`."""
    values = torch.from_numpy(batch.knn_values).to(device).long()
    logw = knn_log_weights(torch.from_numpy(batch.knn_dist).to(device), values, TEMPERATURE)
    target = torch.from_numpy(batch.target).to(device).long()
    return interpolate(torch.from_numpy(batch.logp).to(device), knn_target_logprob(logw, values, target), LAM)


def knnlm_tokens_per_s(lm: LM, neighbors, n_tokens: int, budget: float) -> tuple[float, int, dict | None]:
    """LM + search + interpolation over n_tokens (or what `budget` seconds allow: the rate is measured), after a
    warm-up; with the memory on the device, also the tokens' Θ scores and skips (read with each pass)."""
    vocab = lm.model.config.vocab_size
    for _ in score_tokens(lm, articles(min(n_tokens, 4096), vocab, seed=5), ScoreConfig(), neighbors):
        pass
    seqs, done, started, kept = articles(n_tokens, vocab, seed=1), 0, time.perf_counter(), []
    for batch in score_tokens(lm, seqs, ScoreConfig(), neighbors):
        if batch.theta_logp is None:  # not already computed on the device
            theta_logp(batch, lm.device)
        else:
            kept.append(dict(doc_id=batch.doc_id, position=batch.position, theta_logp=batch.theta_logp,
                             skipped=batch.knn_skipped))
        done += len(batch)
        if time.perf_counter() - started > budget:
            break
    sync(lm.device)
    scored = {f: np.concatenate([k[f] for k in kept]) for f in kept[0]} if kept else None
    return done / (time.perf_counter() - started), done, scored


def ppl_change(plain: dict, skipping: dict) -> dict:
    """Θ's PPL without and with the skip over the tokens both runs scored (the same plan: the same tokens first)."""
    m = min(len(plain["theta_logp"]), len(skipping["theta_logp"]))
    if not all((plain[f][:m] == skipping[f][:m]).all() for f in ("doc_id", "position")):
        raise RuntimeError("the two runs scored different tokens")
    ppl, ppl_skip = (float(np.exp(-run["theta_logp"][:m].mean())) for run in (plain, skipping))
    return {"ppl_tokens": m, "ppl_theta": ppl, "ppl_theta_skip": ppl_skip, "ppl_change_by_skip": ppl_skip / ppl - 1,
            "ppl_note": "Θ's PPL over random-token articles with random weights and random values: the skip's "
                        "effect is measurable (the same tokens, with and without it), not a quality number"}


def decoding(lm: LM, rows: int, prompt: int, new: int, on_device: DeviceTheta | None = None,
             mode: str = "warn") -> dict:
    """Greedy continuations of `rows` random prompts by the served model's Decoder (monim.serving.generate), the
    bare LM or Θ with the memory on the device: tokens/s (prefill included), the host reads of a step
    (monim.lm.host.reads) and unplanned syncs; each row's tokens."""
    rng = np.random.default_rng(6)
    prompts = [" ".join(map(str, rng.integers(1, lm.model.config.vocab_size, prompt))) for _ in range(rows)]
    cfg, out, found = GenerateConfig(max_new_tokens=new, temperature=0.0), [], []

    def run() -> None:
        decoder = Decoder(lm, None, max_rows=rows, on_device=on_device)
        added = [decoder.add(p, cfg) for p in prompts]
        while decoder:
            decoder.advance()
        out[:] = [r.result.tokens for r in added if r.result is not None]

    with no_syncs(lm.device, mode, found):
        seconds = timed(run, lm.device)
    decoder = Decoder(lm, None, max_rows=rows, on_device=on_device)
    for p in prompts:
        decoder.add(p, cfg)
    decoder.advance()  # the prefill and first token
    with host.reads() as counted:
        decoder.advance()  # a step
    return {"rows": rows, "new_tokens": new, "tokens_per_s": rows * new / seconds, "seconds": seconds,
            "host_reads_per_step": sum(counted.values()), "reads_by_kind": dict(counted),
            "unplanned_syncs": syncs(found, lm.device), "first_prompt": prompts[0], "tokens": out}


class RealStats:
    """Real LM statistics (log p, max log p) handed to tokens in order, cycling: which tokens a real LM
    leaves certain."""

    def __init__(self, path: Path = STATS):
        with np.load(path) as f:
            self.logp, self.max_logp = f["logp"].astype(np.float32), f["max_logp"].astype(np.float32)
        self.at = 0

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        rows = (self.at + np.arange(n)) % len(self.logp)
        self.at += n
        return self.logp[rows], self.max_logp[rows]


def paper_day(lm: LM, index: TorchExact, values: np.ndarray, size: dict, knnlm_rate: float, budget: float) -> dict:
    """MoNIM-AMT over a day of `size["day"]` tokens onto `index`, every stage timed: featurize with the
    decision's searches (only of tokens the memory could flip), Θ's scores and the rule; commit (the
    stored entries written atomically, the device index rebuilt with them); calibrate (a sample searched
    at k, its features, the calibrator trained); evaluate (kNN-LM over the day's evaluation tokens at the
    rate measured for this memory on the device, without the skip). Past `budget` seconds the day stops and
    its rates are projected."""
    device, vocab = lm.device, lm.model.config.vocab_size
    real, interp = RealStats(), Interpolation(LAM, TEMPERATURE)
    t = {"featurize_and_search": 0.0, "search": 0.0, "theta_and_rule": 0.0}
    counts = {"tokens": 0, "searched": 0, "stored": 0}
    stored, sample = [], []

    def decide(batch) -> Found:
        """The decision's search: tokens whose decision no memory can change (by a real LM's statistics) are not searched."""
        started = time.perf_counter()
        logp, max_logp = real.take(len(batch))
        batch.logp, batch.max_logp = logp, max_logp
        wanted = ~certain(logp, max_logp, LAM, DELTA, adaptive=True)
        dist, ids = np.full((len(batch), K_DECIDE), np.inf, np.float32), np.full((len(batch), K_DECIDE), -1, np.int64)
        if wanted.any():
            dist[wanted], ids[wanted] = index.search(batch.key[wanted].astype(np.float32), K_DECIDE)
        counts["searched"] += int(wanted.sum())
        t["search"] += time.perf_counter() - started
        return Found(dist, np.where(ids >= 0, values[ids.clip(min=0)], -1), ids, None, ~wanted)

    seqs = articles(size["day"], vocab, seed=3)
    started = time.perf_counter()
    for batch in score_tokens(lm, seqs, ScoreConfig(), decide):
        t0 = time.perf_counter()
        theta = theta_scores(batch, interp, device=device)
        keep = theta.logp < amt_threshold(DELTA, theta.max_logp - theta.logp)
        stored.append((batch.key[keep], batch.target[keep]))
        if sum(len(s) for s in sample) < size["sample"]:
            sample.append(batch.select(slice(0, 512)))
        counts["tokens"] += len(batch)
        counts["stored"] += int(keep.sum())
        t["theta_and_rule"] += time.perf_counter() - t0
        if time.perf_counter() - started > budget:
            break
    sync(device)
    t["featurize_and_search"] = time.perf_counter() - started - t["theta_and_rule"]
    scale = size["day"] / counts["tokens"]  # > 1 where the budget stopped the day early

    t0 = time.perf_counter()
    keys = np.concatenate([s[0] for s in stored])
    with tempfile.TemporaryDirectory() as tmp, replacing(Path(tmp) / "day") as shard:
        shard.mkdir()
        np.save(shard / "keys.npy", keys)
        np.save(shard / "values.npy", np.concatenate([s[1] for s in stored]))
        disk = sum(f.stat().st_size for f in shard.iterdir())
    t["commit_write"] = (time.perf_counter() - t0) * scale
    t0 = time.perf_counter()
    grown = TorchExact(torch.cat([index.keys * index.scale, torch.from_numpy(keys).to(device, index.keys.dtype)]),
                       torch.arange(index.ntotal + len(keys), device=device))
    sync(device)
    t["index_rebuild"] = time.perf_counter() - t0
    del grown

    t0 = time.perf_counter()
    calibrator, _ = calibrated(index, values, TokenScores.concat(sample))
    t["calibrate"] = time.perf_counter() - t0
    t["evaluate"] = size["eval_tokens"] / knnlm_rate
    t["featurize_and_search"] *= scale
    t["search"] *= scale
    t["theta_and_rule"] *= scale
    total = t["featurize_and_search"] + t["theta_and_rule"] + t["commit_write"] + t["index_rebuild"] + t["calibrate"] + t["evaluate"]
    return {"day_tokens": size["day"], "memory_keys": index.ntotal, "tokens_measured": counts["tokens"],
            "searched_share": counts["searched"] / counts["tokens"], "memrate": counts["stored"] / counts["tokens"],
            "stored_bytes_on_disk": disk * scale, "calibrator_epochs": calibrator.summary["epochs"],
            "seconds": t, "day_minutes": total / 60, "projected": scale > 1}


def parity(device: torch.device) -> dict:
    """A tiny model on the CPU (fp32) and in bf16 on `device` (the GPU; without one, the CPU's bf16):
    scores, keys and kNN distributions."""
    seqs = articles(3000, SHAPES["tiny"]["vocab_size"], seed=2)
    out = []
    for where, dtype in (("cpu", torch.float32), (device.type, torch.bfloat16)):
        lm = random_lm("tiny", torch.device("cpu"), torch.float32)  # the same weights on both sides
        lm.model.to(where, dtype)
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


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "gpu")
    ap.add_argument("--quick", action="store_true", help="Small sizes (implied without a GPU).")
    ap.add_argument("--tiny", action="store_true", help="The tiny model at tiny sizes (the tests' dry run).")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"Which sections run, in order ({','.join(SECTIONS)}).")
    ap.add_argument("--syncs", choices=("warn", "error"), default="warn",
                    help="On a GPU, an unplanned sync in a timed device section is listed (warn) or stops it (error).")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if "--out" not in ap.argv and os.environ.get("OUT"):  # the lent GPU machine's folder that comes back
        args.out = Path(os.environ["OUT"]) / "gpu.json"
    size = SIZES["tiny" if args.tiny else "quick" if args.quick or device.type == "cpu" else "full"]
    wanted = set(args.sections.split(","))
    if wanted - set(SECTIONS):
        ap.error(f"--sections: unknown {sorted(wanted - set(SECTIONS))} (sections: {', '.join(SECTIONS)})")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = 64 if device.type == "cuda" else 4
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                    "torch": torch.__version__, "dtype": str(dtype), "sizes": size,
                    "measured": "on a GPU" if device.type == "cuda" else "a CPU dry run at small sizes, not a GPU measurement",
                    "lm": [], "knn": [], "decode": [], "errors": {}}
    path = args.out
    started = time.perf_counter()

    def section(name: str, fn) -> None:
        """Run one section if asked; its error is recorded (the others still run) and the report rewritten."""
        if name.split("-")[0] not in wanted:
            return
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:  # noqa: BLE001  (a benchmark's sections are independent)
            report["errors"][name] = traceback.format_exc()
            print(f"{name} failed:\n{report['errors'][name]}", flush=True)
        report.setdefault("section_seconds", {})[name] = time.perf_counter() - t0
        report["seconds"] = time.perf_counter() - started
        save(path, report, args)

    shape, *others = size["shapes"]
    lm = random_lm(shape, device, dtype)
    width = 1024 if device.type == "cuda" else 128
    report["lm"].append({"model": shape, "bare_tokens_per_s": bare_tokens_per_s(lm, rows, width)})
    bare = report["lm"][0]["bare_tokens_per_s"]
    print(f"{shape}: bare {bare:,.0f} tok/s", flush=True)
    held: dict = {}

    def knn(n: int) -> None:
        row, index = knn_search(n, lm.hidden_size, device, size["queries"])
        values = memory_values(index, lm.model.config.vocab_size)
        budget, n_eval = size["budget"] / 10, size["eval_tokens"]
        rate, done, _ = knnlm_tokens_per_s(lm, memory_neighbors(index, values), n_eval, budget)
        calibrator, lam = calibrated(index, values, sample(lm, size["sample"], seed=4))
        threshold = float(np.median(lam))  # about half the tokens skip
        plain, skipping = memory_on_device(index, values), memory_on_device(index, values, calibrator, threshold)
        scored, found = {}, {}
        for name, theta in (("device", plain), ("skip", skipping)):
            found[name] = []
            with no_syncs(device, args.syncs, found[name]):
                on, on_done, scored[name] = knnlm_tokens_per_s(lm, theta, n_eval, budget)
            row |= {f"knnlm_{name}_tokens_per_s": on, f"knnlm_{name}_ratio_to_bare": on / bare, f"knnlm_{name}_tokens": on_done}
        reads_of = articles(min(n_eval, 8192), lm.model.config.vocab_size, seed=7)
        row |= {"knnlm_tokens_per_s": rate, "knnlm_ratio_to_bare": rate / bare, "knnlm_tokens": done,
                "skip_threshold": threshold, "skipped_share": float(scored["skip"]["skipped"].mean()),
                **ppl_change(scored["device"], scored["skip"]),
                "host_reads_per_pass": {name: reads_per_pass(lm, reads_of, theta) for name, theta
                                        in (("device", plain), ("skip", skipping))},
                "unplanned_syncs": {name: syncs(f, device) for name, f in found.items()}}
        print(f"{n:,} keys: {row['tiled']['queries_per_s']:,.0f} queries/s at k={K} (plain topk "
              f"{row['plain_topk']['queries_per_s']:,.0f}: {row['speedup']:.1f}x), recall "
              f"{row['tiled']['recall_vs_fp32']:.4f}; kNN-LM through the host hook {rate:,.0f} tok/s "
              f"({rate / bare:.3f}x the bare LM), on the device {row['knnlm_device_tokens_per_s']:,.0f} tok/s "
              f"({row['knnlm_device_ratio_to_bare']:.3f}x), with the skip {row['knnlm_skip_tokens_per_s']:,.0f} tok/s "
              f"({row['knnlm_skip_ratio_to_bare']:.3f}x; {row['skipped_share']:.1%} skipped, PPL "
              f"{row['ppl_change_by_skip']:+.2%}); host reads a pass {row['host_reads_per_pass']['device']['per_pass']:.2f}",
              flush=True)
        report["knn"].append(row)
        held.clear()
        held.update(index=index, values=values, rate=row["knnlm_device_tokens_per_s"], on_device=plain)

    def decode() -> None:
        for rows_ in DECODE_ROWS:
            pair = {"bare": decoding(lm, rows_, size["prompt"], size["new"], None, args.syncs),
                    "theta": decoding(lm, rows_, size["prompt"], size["new"], held.get("on_device"), args.syncs)}
            theta = pair["theta"]["tokens_per_s"]
            report["decode"].append({"rows": rows_, "memory_keys": held["index"].ntotal, **pair,
                                     "theta_ratio_to_bare": theta / pair["bare"]["tokens_per_s"],
                                     "theta_ratio_to_batch_1": theta / report["decode"][0]["theta"]["tokens_per_s"]
                                     if report["decode"] else 1.0})
            print(f"decoding {rows_} rows: bare {pair['bare']['tokens_per_s']:,.0f} tok/s, Θ {theta:,.0f} tok/s "
                  f"({report['decode'][-1]['theta_ratio_to_bare']:.2f}x), host reads a step "
                  f"{pair['theta']['host_reads_per_step']}", flush=True)

    def features() -> None:
        for i, name in enumerate(size["shapes"]):
            model = lm if i == 0 else random_lm(name, device, dtype)
            if i > 0:
                report["lm"].append({"model": name, "bare_tokens_per_s": bare_tokens_per_s(model, rows, width)})
            row = report["lm"][i]
            row["featurize"] = featurize(model, size["feat_tokens"] // (1 if i == 0 else 4), args.syncs)
            row["ratio"] = row["featurize"]["tokens_per_s"] / row["bare_tokens_per_s"]
            print(f"{name}: bare {row['bare_tokens_per_s']:,.0f} tok/s, featurization "
                  f"{row['featurize']['tokens_per_s']:,.0f} tok/s ({row['ratio']:.2f}x) in {row['featurize']['passes']} "
                  f"passes, host reads a pass {row['featurize']['host_reads']['per_pass']:.2f}", flush=True)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()

    def day() -> None:
        left = size["deadline"] - (time.perf_counter() - started) - 45  # the commit, calibration and parity after it
        report["paper_day"] = paper_day(lm, held["index"], held["values"], size, held["rate"], min(size["budget"], left))
        d = report["paper_day"]
        print(f"paper-sized day: {d['day_tokens']:,} tokens onto {d['memory_keys']:,} entries in {d['day_minutes']:.2f} min "
              f"(searched {d['searched_share']:.1%}, MemRate {d['memrate']:.1%}): "
              + ", ".join(f"{k} {v:.1f} s" for k, v in d["seconds"].items()), flush=True)

    def fresh() -> None:
        held.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    for n in size["keys"][:1]:
        section(f"knn-{n}", lambda: knn(n))
    section("decode", decode)
    section("featurize", features)
    for n in size["keys"][1:]:
        fresh()
        section(f"knn-{n}", lambda: knn(n))
    section("day", day)
    fresh()
    section("parity", lambda: print(f"parity: {report.setdefault('parity', parity(device))}", flush=True))
    print(f"wrote {path} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
