"""Generation from Θ: the LM interpolated with the memory under the calibrator's per-token λ.

Each step runs the LM on the new token only (its KV cache holds the prefix), searches the memory
with the step's key, and samples (or takes the top token of) Θ's full next-token distribution.
The memorized articles whose entries carried the chosen tokens' kNN weight are its sources
(monim.serving.sentences). A Decoder continues many prompts together, one LM forward and one search
a step for all of them; `generate` is a Decoder of one.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from transformers import DynamicCache

from monim.data.feed import short_title
from monim.lm.model import LM, kv_layers
from monim.lm.token_scores import TokenScores
from monim.serving.generation import GenerateConfig, Generation
from monim.serving.sentences import sentences
from monim.theta.memory import Memory
from monim.theta.ralm import in_context, reach, with_article


def _step_scores(lm: LM, hidden: torch.Tensor, keys: torch.Tensor, prev: list[int], position: list[int]) -> tuple[TokenScores, torch.Tensor]:
    """The LM's statistics for the next token after each of n final hidden states [n, d], and its log P [n, V]."""
    logp = torch.log_softmax(lm.logits(hidden), dim=-1)
    top = logp.max(dim=-1)
    best, argmax = top.values.float().cpu().numpy(), top.indices.cpu().numpy().astype(np.int32)
    batch = TokenScores(
        doc_id=np.array(["generation"] * len(prev), dtype=object), position=np.array(position, np.int32),
        prev=np.array(prev, np.int32), target=argmax, logp=best, max_logp=best.copy(),
        entropy=(-(logp.exp() * logp).sum(-1)).float().cpu().numpy(), argmax=argmax.copy(),
        key=keys.to(torch.float16).cpu().numpy(),
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


class Row:
    """One prompt's continuation in a Decoder: its tokens so far, and its Generation once it ended."""

    def __init__(self, prompt: str, ids: list[int], cfg: GenerateConfig, should_stop: Callable[[], str | None] | None):
        self.prompt, self.ids, self.cfg, self.should_stop = prompt, ids, cfg, should_stop
        self.rng = torch.Generator().manual_seed(cfg.seed)
        self.tokens: list[int] = []
        self.lams: list[float] = []
        self.logprobs: list[np.ndarray] = []
        self.credit: list[dict] = []  # per token: {memory entry id: the kNN weight it carried}
        self.sources: list[dict] = []  # the article retrieved into its context
        self.result: Generation | None = None

    @property
    def length(self) -> int:
        """Tokens in its context: the prompt and what was written."""
        return len(self.ids) + len(self.tokens)


def _similar(rows: list[Row], budget: int = 2048) -> list[list[Row]]:
    """Rows in groups to prefill together: longest first, a group's padding at most half its prompts'
    tokens and its padded tokens at most `budget` (a long prompt is prefilled alone)."""
    groups: list[list[Row]] = []
    for row in sorted(rows, key=lambda r: -len(r.ids)):
        group = groups[-1] if groups else []
        padded = (len(group) + 1) * len(group[0].ids) if group else 0
        if group and padded <= budget and 2 * padded <= 3 * (sum(len(r.ids) for r in group) + len(row.ids)):
            group.append(row)
        else:
            groups.append([row])
    return groups


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    """A cache tensor [batch, heads, seq, dim] with n zero columns before its first (masked out)."""
    return torch.nn.functional.pad(t, (0, 0, n, 0)) if n else t


class Decoder:
    """Continuations decoded together: each step runs ONE LM forward (a left-padded KV cache, a 2-D
    attention mask, each row's own positions) and ONE memory search for every active row. A row
    added joins at the next step the batch has room for it (its prompt prefilled with those of its
    length joining then, its cache merged in) and leaves the batch when it ends; each row writes
    what it would write alone (to float32's precision: an LM in bfloat16 or float16 decodes one row
    at a time, their rounding would make a row's tokens depend on its batch)."""

    def __init__(self, lm: LM, memory: Memory | None = None, max_rows: int | None = None, max_cells: int = 32768):
        self.max_rows = max_rows or (64 if lm.model.dtype == torch.float32 else 1)
        self.lm, self.memory, self.max_cells = lm, memory, max_cells
        self.searched = memory if memory is not None and memory.retrieves else None  # Θ's memory, searched each step
        if self.searched is not None:
            self.searched.sync()
        self.waiting: list[Row] = []  # added, prefilled once the batch has room (first come, first in)
        self.active: list[Row] = []  # in the batch, in the cache's row order
        self.cache, self.mask = self._empty()  # mask [rows, columns]: 1 where the cache holds a token, 0 padding

    def __len__(self) -> int:
        return len(self.waiting) + len(self.active)

    def add(self, prompt: str, cfg: GenerateConfig | None = None,
            should_stop: Callable[[], str | None] | None = None) -> Row:
        """A prompt to continue from the next step on (ValueError: it cannot be)."""
        cfg = cfg or GenerateConfig()
        ids = self.lm.tokenizer(prompt)["input_ids"]
        if not ids:
            raise ValueError("the prompt is empty")
        config = self.lm.model.config
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if limit and len(ids) + cfg.max_new_tokens > limit:
            raise ValueError(f"the prompt ({len(ids)} tokens) and max_new_tokens ({cfg.max_new_tokens}) exceed the "
                             f"model's {limit} positions")
        article = None
        if cfg.retrieve or in_context(self.memory):
            if self.memory is None:
                raise ValueError("retrieve needs a memory: its articles are what is retrieved")
            ids, article = with_article(self.lm, self.memory, prompt, ids, reach(self.memory) - cfg.max_new_tokens)
        row = Row(prompt, ids, cfg, should_stop)
        row.sources = [] if article is None else [{"date": article.date, "doc_id": article.id,
                                                    "title": short_title(article.title)}]
        self.waiting.append(row)
        return row

    @torch.inference_mode()
    def advance(self) -> list[Row]:
        """Every row one token further (each asked first whether it should stop); the rows that ended."""
        ended = [r for r in self.active + self.waiting if self._stopped(r)]
        self.waiting = [r for r in self.waiting if r.result is None]
        self._keep([r.result is None for r in self.active])
        hidden, keys = self._forward() if self.active else ([], [])
        for group in _similar(joining := self._room()):  # new prompts, prefilled together, then rows of the batch
            h, k = self._prefill(group)
            self.active, hidden, keys = self.active + group, hidden + h, keys + k
        self.waiting = self.waiting[len(joining):]
        if not self.active:
            return ended
        rows = self.active
        prev = [r.tokens[-1] if r.tokens else r.ids[-1] for r in rows]
        batch, logp = _step_scores(self.lm, torch.cat(hidden), torch.cat(keys), prev, [r.length for r in rows])
        lam, knn = np.zeros(len(rows)), None  # knn: the neighbours found and their kNN weights
        if self.searched is not None:
            found = self.searched.search(batch)
            batch.knn_dist, batch.knn_values, batch.knn_ids, batch.knn_prior, batch.knn_skipped = found
            logp, lam, knn_w = self.searched.theta_logprobs(batch, logp)
            knn = (found, knn_w)
        eos = self.lm.tokenizer.eos_token_id
        for i, row in enumerate(rows):
            token = _choose(logp[i], row.cfg, row.rng)
            weights = {}
            if knn is not None and lam[i] > 0:  # the entries whose value is the chosen token carried its kNN weight
                found, knn_w = knn
                for j in np.flatnonzero(found.values[i] == token):
                    weights[int(found.ids[i, j])] = float(lam[i]) * float(knn_w[i, j])
            if row.cfg.keep_distributions:
                row.logprobs.append(logp[i].numpy())
            row.tokens.append(token)
            row.lams.append(float(lam[i]))
            row.credit.append(weights)
            if token == eos or len(row.tokens) == row.cfg.max_new_tokens:
                self._end(row, "eos" if token == eos else "max_new_tokens")
                ended.append(row)
        self._keep([r.result is None for r in rows])
        return ended

    def _room(self) -> list[Row]:
        """The first waiting rows the batch has room for: at most `max_rows` rows, and at most `max_cells`
        tokens in its padded cache (rows × the longest context; a first row always fits)."""
        rows, columns = len(self.active), self.mask.shape[1]
        for n, row in enumerate(self.waiting):
            rows, columns = rows + 1, max(columns, len(row.ids))
            if rows > 1 and (rows > self.max_rows or rows * columns > self.max_cells):
                return self.waiting[:n]
        return self.waiting

    def _stopped(self, row: Row) -> bool:
        """Whether the row's `should_stop` ends it before its next token (then it has its result)."""
        reason = row.should_stop() if row.should_stop is not None else None
        if reason:
            self._end(row, reason)
        return bool(reason)

    def _forward(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The batch's last tokens through the LM in one pass: final hidden states and keys, [1, d] per row."""
        rows, device = self.active, self.lm.device
        self.mask = torch.cat([self.mask, torch.ones(len(rows), 1, dtype=self.mask.dtype, device=device)], 1)
        ids = torch.tensor([[r.tokens[-1]] for r in rows], device=device)
        pos = torch.tensor([[r.length - 1] for r in rows], device=device)
        mask = None if bool(self.mask.all()) else self.mask  # no padding: the path a row alone takes
        hidden, keys = self.lm.forward(ids, attention_mask=mask, position_ids=pos, past=self.cache)
        return list(hidden[:, -1:].unbind(0)), list(keys[:, -1:].unbind(0))

    def _prefill(self, rows: list[Row]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """New prompts through the LM in one pass (left-padded to the longest; a prompt alone as it is),
        their cache joined to the batch's: final hidden states and keys of their last tokens, [1, d] per row."""
        longest, device = max(len(r.ids) for r in rows), self.lm.device
        ids = torch.tensor([[0] * (longest - len(r.ids)) + r.ids for r in rows], device=device)
        mask = torch.tensor([[0] * (longest - len(r.ids)) + [1] * len(r.ids) for r in rows], device=device)
        cache = DynamicCache(config=self.lm.model.config)
        hidden, keys = self.lm.forward(ids, attention_mask=None if bool(mask.all()) else mask,
                                       position_ids=(mask.cumsum(1) - 1).clamp(min=0), past=cache)
        self._join(cache, mask)
        return list(hidden[:, -1:].unbind(0)), list(keys[:, -1:].unbind(0))

    def _join(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        """Prefilled rows' cache (and its mask) after the batch's rows: both left-padded to the longer."""
        if not self.active:
            self.cache, self.mask = cache, mask
            return
        columns = max(self.mask.shape[1], mask.shape[1])
        for (mine, my_keys, my_values), (_, their_keys, their_values) in zip(kv_layers(self.cache), kv_layers(cache)):
            held = max(my_keys.shape[-2], their_keys.shape[-2])  # a sliding-window layer holds its window only
            mine.keys, mine.values = (torch.cat([_pad_left(a, held - a.shape[-2]), _pad_left(b, held - b.shape[-2])])
                                      for a, b in ((my_keys, their_keys), (my_values, their_values)))
            if hasattr(mine, "cumulative_length"):
                mine.cumulative_length = columns
        pad = torch.nn.functional.pad
        self.mask = torch.cat([pad(self.mask, (columns - self.mask.shape[1], 0)), pad(mask, (columns - mask.shape[1], 0))])

    def _keep(self, keep: list[bool]) -> None:
        """Only these rows of the batch (the others ended), and no column that is padding in every row."""
        if all(keep):
            return
        self.active = [r for r, k in zip(self.active, keep) if k]
        if not self.active:
            self.cache, self.mask = self._empty()
            return
        index = torch.tensor([i for i, k in enumerate(keep) if k], device=self.lm.device)
        self.mask = self.mask[index]
        columns = self.mask.shape[1]
        drop = int(self.mask.any(0).long().argmax())  # the leading columns no row uses
        for layer, keys, values in kv_layers(self.cache):
            held = min(keys.shape[-2], columns - drop)
            layer.keys, layer.values = (t[index, :, t.shape[-2] - held:] for t in (keys, values))
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = columns - drop
        self.mask = self.mask[:, drop:]

    def _empty(self) -> tuple[DynamicCache, torch.Tensor]:
        """The cache and mask of a batch without rows."""
        return DynamicCache(config=self.lm.model.config), torch.zeros((0, 0), dtype=torch.long, device=self.lm.device)

    def _end(self, row: Row, stopped: str) -> None:
        """The row's Generation, with its sentences and their sources."""
        lm = self.lm
        row.result = Generation(row.prompt, lm.decode(row.tokens, skip_special_tokens=True), row.tokens,
                                row.lams, stopped=stopped, logprobs=row.logprobs if row.cfg.keep_distributions else None,
                                sources=row.sources)
        row.result.sentences = sentences(lm, self.memory, row.tokens, row.credit, row.cfg.sources)


@torch.inference_mode()
def generate(lm: LM, prompt: str, memory: Memory | None = None, cfg: GenerateConfig | None = None,
             should_stop: Callable[[], str | None] | None = None) -> Generation:
    """Continue `prompt` with Θ (the LM alone without a memory, or where Θ fell back to it): a
    Decoder of one row; `should_stop` is asked before each token and may end it with a reason."""
    decoder = Decoder(lm, memory)
    row = decoder.add(prompt, cfg, should_stop)
    while (result := row.result) is None:
        decoder.advance()
    return result

