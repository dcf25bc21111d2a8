"""Window planning: the spans of tokens each forward pass feeds and keeps, fitted to the model and device."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

from monim.core.config import ScoreConfig
from monim.lm.model import LM

# device type -> (rows per forward pass, tokens per vocabulary projection, tokens planned together) where the
# config leaves them open: a GPU needs large batches to be busy (and a plan large enough to fill them); a CPU
# runs as fast with 8 rows and keeps the logits small
DEVICE_BATCH = {"cpu": (8, 256, 1 << 16), "cuda": (128, 1024, 1 << 20)}

Sequence = tuple[str, list[int], int]  # id, token ids, first target position


@dataclass
class Span:
    """Inputs tokens[a:e] of a sequence in one row, predicting tokens[a+1:e+1]; outputs kept from input `keep`."""

    seq_id: str
    toks: list[int]
    a: int
    e: int
    keep: int


def windows(n_tokens: int, cfg: ScoreConfig, first: int = 1) -> Iterator[tuple[int, int, int]]:
    """(a, s, e): feed tokens[a:e-1] to predict the targets tokens[s:e], with s - 1 - a <= context.

    Targets start at position `first` (1: every token after the first)."""
    for s in range(max(first, 1), n_tokens, cfg.stride):
        yield max(0, s - 1 - cfg.context), s, min(s + cfg.stride, n_tokens)


def blocks(n_tokens: int, cfg: ScoreConfig, first: int = 1) -> list[Span]:
    """The steps of one sequence under carry/document context: the first step feeds the first
    window whole (its context included), each later one `stride` new inputs."""
    first = max(first, 1)
    a0 = 0 if cfg.context_mode == "document" else max(0, first - 1 - cfg.context)
    cuts = [a0, *range(first - 1 + cfg.stride, n_tokens - 1, cfg.stride), n_tokens - 1]
    return [Span("", [], a, e, max(a, first - 1)) for a, e in zip(cuts, cuts[1:])]


def fit_window(lm: LM, cfg: ScoreConfig) -> ScoreConfig:
    """The config fitted to the model: context + stride shrunk (context first) to its maximum
    positions; a model that cannot carry context (no rotary positions, or a KV cache that cannot
    be cut to its last entries) recomputes the windows; batch and head chunk left open are the device's."""
    rows, chunk, _ = DEVICE_BATCH.get(lm.device.type, DEVICE_BATCH["cpu"])
    cfg = replace(cfg, batch_size=cfg.batch_size or rows, head_chunk=cfg.head_chunk or chunk)
    limit = getattr(lm.model.config, "n_positions", None) or getattr(lm.model.config, "max_position_embeddings", None)
    if cfg.context_mode != "recompute" and not (hasattr(lm.model.base_model, "rotary_emb") and lm.stepwise):
        cfg = replace(cfg, context_mode="recompute")
    if not limit or cfg.context + cfg.stride <= limit:
        return cfg
    stride = min(cfg.stride, limit)
    return replace(cfg, stride=stride, context=limit - stride)


def batching(cfg: ScoreConfig) -> tuple[int, int]:
    """A fitted config's rows per forward pass and tokens per vocabulary projection (fit_window sets both)."""
    if cfg.batch_size is None or cfg.head_chunk is None:
        raise ValueError("the scoring config is not fitted to the model (monim.lm.windows.fit_window)")
    return cfg.batch_size, cfg.head_chunk


def plan(seqs: list[Sequence], cfg: ScoreConfig) -> tuple[list[Span], list[list[list[Span]]]]:
    """A buffer of sequences as one-step spans (to pack) and groups of sequences stepped in lockstep
    (the same first step; each group longest first)."""
    single: list[Span] = []
    stepped: dict[int, list[list[Span]]] = {}
    for seq_id, toks, first in seqs:
        if cfg.context_mode == "recompute":
            single += [Span(seq_id, toks, a, e - 1, s - 1) for a, s, e in windows(len(toks), cfg, first)]
            continue
        steps = [replace(sp, seq_id=seq_id, toks=toks) for sp in blocks(len(toks), cfg, first) if sp.e > sp.a]
        if len(steps) == 1:
            single += steps
        elif steps:
            stepped.setdefault(steps[0].e - steps[0].a, []).append(steps)
    for group in stepped.values():
        group.sort(key=len, reverse=True)
    return single, list(stepped.values())


def pack(spans: list[Span], cfg: ScoreConfig) -> list[list[Span]]:
    """Independent spans packed into rows of about `stride + context` inputs (longest first, first fit)."""
    cap = max(cfg.stride + (cfg.context if cfg.context_mode == "recompute" else 0), max(s.e - s.a for s in spans))
    rows: list[list[Span]] = []
    room: list[int] = []
    for sp in sorted(spans, key=lambda s: s.a - s.e):
        i = next((i for i, r in enumerate(room) if r >= sp.e - sp.a), None)
        if i is None:
            rows.append([])
            room.append(cap)
            i = len(rows) - 1
        rows[i].append(sp)
        room[i] -= sp.e - sp.a
    return rows
