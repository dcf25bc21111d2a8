"""Parametric continual learning, the paper's baselines beside memory: each day trains the LM's
weights on the day's training articles (plain fine-tuning, Mix-Review, RecAdam) instead of
memorizing them, and keeps that day's weights.

- finetune: causal-LM loss on the day's tokens, Adam, the previous day's weights as the start.
- mix-review (He et al. 2021): the same, with general-domain tokens mixed in, mix_ratio ×
  mix_decay^d times the day's tokens on the stream's d-th day (d = 0, 1, ...): review tapers off
  to plain fine-tuning.
- recadam (Chen et al. 2020): Adam whose step is scaled by λ(t) = sigmoid(k (t - t0)), and a
  decoupled pull lr (1 - λ(t)) γ (θ - θ*) toward the pretrained weights θ*; t counts optimizer
  steps over the whole stream, so the pull is annealed away as learning goes on.

Each day's weights are one safetensors file in `<dir>/<date>/`, beside a meta.json; the folder is
written aside and renamed (atomic), so a day is trained once and a re-run changes nothing.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from monim.core.atomic import is_stray, replacing, write_json
from monim.core.config import Learner
from monim.data.feed import Document
from monim.lm.model import LM

WEIGHTS = "model.safetensors"


def blocks(ids: list[list[int]], block: int, max_tokens: int | None) -> list[list[int]]:
    """Documents' tokens concatenated (first ones first, at most max_tokens) and cut into blocks."""
    flat = [t for doc in ids for t in doc][:max_tokens]
    return [flat[i : i + block] for i in range(0, len(flat), block) if len(flat[i : i + block]) >= 2]


def review_blocks(lm: LM, learner: Learner, tokens: int, rng: np.random.Generator) -> list[list[int]]:
    """About `tokens` general-domain tokens, as blocks drawn at random from the review text (none without one)."""
    if tokens <= 0 or learner.review is None:
        return []
    text = Path(learner.review).read_text(encoding="utf-8")[learner.review_from :]
    ids = lm.tokenizer(text)["input_ids"]
    starts = rng.choice(max(1, len(ids) - learner.train_block), size=max(1, round(tokens / learner.train_block)), replace=True)
    return [ids[s : s + learner.train_block] for s in starts]


def train_day(lm: LM, docs: list[Document], learner: Learner, day_index: int, optimizer_step: int,
              pretrained: dict[str, torch.Tensor] | None = None) -> dict:
    """Train lm.model in place on the documents (plus review text); returns what it did, with the
    stream's optimizer step count after the day."""
    if learner.method == "recadam" and pretrained is None:
        raise ValueError("recadam pulls toward the pretrained weights: pass them")
    started = time.perf_counter()
    rng = np.random.default_rng([learner.seed, day_index])
    torch.manual_seed(learner.seed + day_index)
    new = blocks(lm.tokenizer([d.text for d in docs])["input_ids"] if docs else [], learner.train_block, learner.train_tokens)
    new_tokens = sum(len(b) for b in new)
    review = review_blocks(lm, learner, round(learner.review_share(day_index) * new_tokens), rng)
    data = new + review
    model = lm.model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=learner.lr)
    model.train()
    losses = []
    try:
        for _ in range(learner.epochs):
            order = rng.permutation(len(data))
            for first in range(0, len(order), learner.train_batch):
                batch = [data[j] for j in order[first : first + learner.train_batch]]
                loss = _loss(lm, batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                lam = learner.anneal(optimizer_step)
                for group in optimizer.param_groups:
                    group["lr"] = learner.lr * lam
                optimizer.step()
                if learner.method == "recadam" and pretrained is not None:
                    with torch.no_grad():
                        for name, p in model.named_parameters():
                            p.sub_(learner.lr * (1 - lam) * learner.pretrain_coef * (p - pretrained[name]))
                losses.append(loss.item())
                optimizer_step += 1
    finally:
        model.eval()
        optimizer.zero_grad(set_to_none=True)
    return {"tokens_trained": new_tokens, "review_tokens": sum(len(b) for b in review), "steps": len(losses),
            "step": optimizer_step, "train_loss": float(np.mean(losses)) if losses else math.nan,
            "seconds_train": time.perf_counter() - started}


def _loss(lm: LM, batch: list[list[int]]) -> torch.Tensor:
    """Mean next-token cross-entropy over a batch of token blocks (padding ignored)."""
    width = max(len(b) for b in batch)
    ids = torch.full((len(batch), width), lm.tokenizer.pad_token_id or 0, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, b in enumerate(batch):
        ids[i, : len(b)] = torch.tensor(b)
        labels[i, : len(b)] = torch.tensor(b)
        mask[i, : len(b)] = 1
    out = lm.model(input_ids=ids.to(lm.device), attention_mask=mask.to(lm.device), labels=labels.to(lm.device))
    return out.loss


class Weights:
    """A parametric run's weights, one folder per trained day: `<root>/<date>/model.safetensors`
    and meta.json (what the day's training did, and the optimizer step count it ended at)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def days(self) -> list[str]:
        """The committed days, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p.parent.name for p in self.root.glob(f"*/{WEIGHTS}") if not is_stray(p.parent))

    def latest(self, before: str | None = None) -> str | None:
        """The newest committed day (strictly before `before`, if given)."""
        days = [d for d in self.days() if before is None or d < before]
        return days[-1] if days else None

    def as_of(self, date: str) -> str | None:
        """The day whose weights stood after `date`: the newest committed day up to it."""
        days = [d for d in self.days() if d <= date]
        return days[-1] if days else None

    def meta(self, date: str) -> dict:
        return json.loads((self.root / date / "meta.json").read_text())

    def load(self, date: str) -> dict[str, torch.Tensor]:
        return load_file(self.root / date / WEIGHTS)

    def save(self, date: str, model: torch.nn.Module, meta: dict) -> None:
        """Commit a day's weights and meta as one folder (appears whole or not at all)."""
        with replacing(self.root / date) as tmp:
            tmp.mkdir()
            state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
            save_file(_untied(state), tmp / WEIGHTS)
            write_json(tmp / "meta.json", meta)

    def bytes_on_disk(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file()) if self.root.is_dir() else 0


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with tensors that share storage (tied embeddings) kept once: safetensors
    refuses shared tensors; load_state_dict(strict=False) restores the tie."""
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = t
    return out


def trained_copy(base: LM) -> LM:
    """A second LM with the base's tokenizer and its own copy of the weights, to train or to load a
    day into (built from the config: a deep copy would carry the base's key hook along)."""
    model = AutoModelForCausalLM.from_config(base.model.config, dtype=base.model.dtype)
    model.load_state_dict(base.model.state_dict())
    return LM(model=model.to(base.device).eval(), tokenizer=base.tokenizer, name=base.name)


def load_day(lm: LM, weights: Weights, date: str | None, base: LM) -> None:
    """Put the weights of `date` (None: the base LM's) into lm.model."""
    state = base.model.state_dict() if date is None else weights.load(date)
    missing, unexpected = lm.model.load_state_dict(state, strict=False)
    if unexpected or any(not _tied(lm.model, k) for k in missing):
        raise ValueError(f"{weights.root / str(date)} does not fit {base.name}: missing {missing}, unexpected {unexpected}")


def _tied(model: torch.nn.Module, name: str) -> bool:
    """Whether a parameter missing from a file is the output embedding tied to the input's."""
    return name.endswith("lm_head.weight") and bool(getattr(model.config, "tie_word_embeddings", False))
