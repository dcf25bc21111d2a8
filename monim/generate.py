"""Generation from Θ: the LM interpolated with the memory under the calibrator's per-token λ.

Each step runs the LM on the new token only (its KV cache holds the prefix), searches the memory
with the step's key, and samples (or takes the top token of) Θ's full next-token distribution.
The memorized articles whose entries carried the chosen tokens' kNN weight are its sources.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch
from transformers import DynamicCache

from monim.lm import LM
from monim.memory import Memory
from monim.scoring import TokenScores

SENTENCE_END = (".", "!", "?")  # and a blank line


@dataclass
class GenerateConfig:
    """How to generate: greedy at temperature 0, else sampled (nucleus `top_p`)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    sources: int = 3  # memorized articles listed per generated sentence
    keep_distributions: bool = False  # keep Θ's log-probabilities at each step (Generation.logprobs)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.sources < 0:
            raise ValueError(f"sources must be >= 0, got {self.sources}")


@dataclass
class Source:
    """A memorized article and the kNN weight its entries gave the tokens of a sentence."""

    date: str
    doc_id: str
    title: str
    weight: float


@dataclass
class Generation:
    """A prompt's continuation, the kNN weight λ of each step, and each sentence with its sources."""

    prompt: str
    text: str
    tokens: list[int]
    lams: list[float]
    sentences: list[dict] = field(default_factory=list)  # {"text", "sources": [Source as dict]}
    stopped: str = "max_new_tokens"  # why it ended: max_new_tokens, eos, or what `should_stop` said (a time limit, ...)
    logprobs: list[np.ndarray] | None = None  # Θ's log P over the vocabulary before each step

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "logprobs"}


def _step_scores(lm: LM, hidden: torch.Tensor, key: torch.Tensor, prev: int, position: int) -> tuple[TokenScores, torch.Tensor]:
    """The LM's statistics for the next token after one hidden state (a one-token batch), and its log P."""
    logp = torch.log_softmax(lm.logits(hidden[None]), dim=-1)[0]
    top = logp.max(dim=-1)
    batch = TokenScores(
        doc_id=np.array(["generation"], dtype=object), position=np.array([position], np.int32),
        prev=np.array([prev], np.int32), target=np.array([int(top.indices)], np.int32),
        logp=np.array([float(top.values)], np.float32), max_logp=np.array([float(top.values)], np.float32),
        entropy=np.array([float(-(logp.exp() * logp).sum())], np.float32),
        argmax=np.array([int(top.indices)], np.int32), key=key[None].to(torch.float16).cpu().numpy(),
    )
    return batch, logp.double().cpu()


def _choose(logp: torch.Tensor, cfg: GenerateConfig, rng: torch.Generator) -> int:
    """The top token at temperature 0; else a sample from the nucleus of the tempered distribution."""
    if cfg.temperature == 0:
        return int(logp.argmax())
    probs = torch.softmax(logp / cfg.temperature, dim=-1)
    order = probs.argsort(descending=True)
    sorted_p = probs[order]
    keep = sorted_p.cumsum(0) - sorted_p < cfg.top_p  # the smallest prefix reaching top_p
    choice = torch.multinomial(sorted_p * keep / (sorted_p * keep).sum(), 1, generator=rng)
    return int(order[choice])


def _documents(memory: Memory, ids: list[int]) -> dict[int, tuple[str, str, str]]:
    """(day, document id, title) of memory entry ids."""
    ds = memory.ds
    day, row = ds.locate(np.array(ids, np.int64))
    out = {}
    for i in np.unique(day[day >= 0]):
        rec = ds.days[i]
        docs, names = np.asarray(ds.shard(rec.shard, "docs")), ds.shard_docs(rec.shard)
        titles = ds.shard_titles(rec.shard) or [""] * len(names)
        for j in np.flatnonzero(day == i):
            d = int(docs[row[j]])
            out[ids[j]] = (rec.date, names[d], titles[d])
    return out


@torch.inference_mode()
def generate(lm: LM, prompt: str, memory: Memory | None = None, cfg: GenerateConfig | None = None,
             should_stop: Callable[[], str | None] | None = None) -> Generation:
    """Continue `prompt` with Θ (the LM alone without a memory, or where Θ fell back to it);
    `should_stop` is asked before each token and may end the continuation with a reason."""
    cfg = cfg or GenerateConfig()
    ids = lm.tokenizer(prompt)["input_ids"]
    if not ids:
        raise ValueError("the prompt is empty")
    limit = getattr(lm.model.config, "max_position_embeddings", None) or getattr(lm.model.config, "n_positions", None)
    if limit and len(ids) + cfg.max_new_tokens > limit:
        raise ValueError(f"the prompt ({len(ids)} tokens) and max_new_tokens ({cfg.max_new_tokens}) exceed the "
                         f"model's {limit} positions")
    retrieve = memory is not None and memory.retrieves
    if retrieve:
        memory.sync()
    rng = torch.Generator().manual_seed(cfg.seed)
    cache = DynamicCache(config=lm.model.config)
    eos = lm.tokenizer.eos_token_id
    context, new = list(ids), list(ids)
    out, lams, logprobs, credit = [], [], [], []
    stopped = "max_new_tokens"
    for _ in range(cfg.max_new_tokens):
        if should_stop is not None and (reason := should_stop()):
            stopped = reason
            break
        pos = torch.arange(len(context) - len(new), len(context), device=lm.device)[None]
        hidden, keys = lm.forward(torch.tensor([new], device=lm.device), position_ids=pos, past=cache)
        batch, logp = _step_scores(lm, hidden[0, -1], keys[0, -1], context[-1], len(context))
        lam, weights = 0.0, {}
        if retrieve:
            batch.knn_dist, batch.knn_values, batch.knn_ids, batch.knn_prior, batch.knn_skipped = memory.search(batch)
            logp, lam, knn_w = memory.theta_logprobs(batch, logp[None])
            logp, lam, knn_w = logp[0], float(lam[0]), knn_w[0]
        token = _choose(logp, cfg, rng)
        if retrieve and lam > 0:  # the entries whose value is the chosen token carried its kNN weight
            for j in np.flatnonzero(batch.knn_values[0] == token):
                weights[int(batch.knn_ids[0, j])] = lam * float(knn_w[j])
        if cfg.keep_distributions:
            logprobs.append(logp.numpy())
        out.append(token)
        lams.append(lam)
        credit.append(weights)
        if token == eos:
            stopped = "eos"
            break
        context.append(token)
        new = [token]
    gen = Generation(prompt, lm.tokenizer.decode(out, skip_special_tokens=True), out, lams, stopped=stopped,
                     logprobs=logprobs if cfg.keep_distributions else None)
    gen.sentences = _sentences(lm, memory, out, credit, cfg.sources)
    return gen


def _sentences(lm: LM, memory: Memory | None, tokens: list[int], credit: list[dict], top: int) -> list[dict]:
    """The generated text cut into sentences, each with the `top` memorized articles that carried
    the most kNN weight over its tokens."""
    spans, start = [], 0
    pieces = [lm.tokenizer.decode([t]) for t in tokens]
    for i, piece in enumerate(pieces):
        after = pieces[i + 1][:1] if i + 1 < len(pieces) else " "
        # a mark ends a sentence only before a space: "2.277" does not (an abbreviation like "U.S. x" still does)
        ends = piece.rstrip().endswith(SENTENCE_END) and (piece[-1:].isspace() or after.isspace())
        if ends or "\n\n" in piece or i == len(tokens) - 1:
            spans.append((start, i + 1))
            start = i + 1
    everything = sorted({e for c in credit for e in c})
    docs = _documents(memory, everything) if memory is not None and everything else {}
    out = []
    for a, b in spans:
        per_doc: dict[tuple, float] = defaultdict(float)
        for c in credit[a:b]:
            for entry, w in c.items():
                if entry in docs:
                    per_doc[docs[entry]] += w
        best = sorted(per_doc.items(), key=lambda kv: -kv[1])[:top]
        out.append({"text": lm.tokenizer.decode(tokens[a:b], skip_special_tokens=True),
                    "sources": [asdict(Source(*doc, weight=w)) for doc, w in best]})
    return out
