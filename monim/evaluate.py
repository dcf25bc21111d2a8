"""Evaluation: perplexity and next-word accuracy of the bare LM and of LM + memory."""

from __future__ import annotations

import math

import numpy as np

from monim.knnlm import Interpolation, theta_scores
from monim.lm import LM, ScoreConfig, score
from monim.memory import Memory
from monim.stream import Document


def evaluate(lm: LM, docs: list[Document], memory: Memory | None = None, cfg: ScoreConfig | None = None) -> dict:
    """PPL and top-1 next-word accuracy of the LM alone and with the memory (Θ: its calibrator or
    constant λ), and the share of tokens whose retrieval the skip gate skipped."""
    use_memory = memory is not None and len(memory) > 0
    if use_memory:
        memory.searched = memory.skipped = 0
    batches = memory.score(docs, cfg) if use_memory else list(score(lm, docs, cfg))
    n, nll_lm, nll, hits_lm, hits = 0, 0.0, 0.0, 0, 0
    for b in batches:
        # the LM's own scores when b has no neighbours
        theta = memory.theta_scores(b) if use_memory else theta_scores(b, Interpolation(), len(lm.tokenizer))
        n += len(b)
        nll_lm -= float(b.logp.astype(np.float64).sum())
        hits_lm += int((b.argmax == b.target).sum())
        nll -= float(theta.logp.sum())
        hits += int((theta.argmax == b.target).sum())
    if not n:
        return {"tokens": 0, "ppl_lm": math.nan, "ppl": math.nan, "accuracy_lm": math.nan, "accuracy": math.nan,
                "skipped": math.nan}
    return {"tokens": n, "ppl_lm": math.exp(nll_lm / n), "ppl": math.exp(nll / n), "accuracy_lm": hits_lm / n,
            "accuracy": hits / n, "skipped": memory.skipped / n if use_memory else 0.0}
