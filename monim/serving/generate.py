"""Generation from Θ: the LM interpolated with the memory under the calibrator's per-token λ.

Each step runs the LM on the new token only (its KV cache holds the prefix), searches the memory
with the step's key, and samples (or takes the top token of) Θ's full next-token distribution.
The memorized articles whose entries carried the chosen tokens' kNN weight are its sources
(monim.serving.sentences). A Decoder continues many prompts together, one LM forward and one search
a step for all of them; `generate` is a Decoder of one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from transformers import DynamicCache

from monim.data.feed import short_title
from monim.lm.device import attention_mask, own_masks, upload
from monim.lm.host import to_host
from monim.lm.model import LM, kv_layers
from monim.lm.token_scores import OnDevice, TokenScores
from monim.serving.generation import GenerateConfig, Generation
from monim.serving.sentences import sentences
from monim.theta.knnlm import row_lam, theta_logprobs
from monim.theta.ralm import in_context, reach, with_article

if TYPE_CHECKING:  # its type only: the Decoder runs without FAISS (benchmarks/gpu.py on a machine without it)
    from monim.theta.memory import Memory


def _step(keys: torch.Tensor, logp: torch.Tensor) -> dict[str, torch.Tensor]:
    """The LM's statistics for the next token of n rows (their keys [n, d] and log P [n, V]) as a chunk
    of a scored pass (monim.lm.scoring: key, stats, argmax; the top token taken as the target), on the LM's device."""
    top = logp.max(dim=-1)
    argmax = top.indices.to(torch.int32)
    return dict(key=keys.to(torch.float16), stats=torch.stack([top.values, top.values, -(logp.exp() * logp).sum(-1)], 1).float(),
                argmax=argmax, target=argmax)


def _step_scores(chunk: dict[str, torch.Tensor], prev: list[int], position: list[int]) -> TokenScores:
    """A step's statistics (`_step`) read to the host at once: what a memory searched on the host takes."""
    stats = to_host({f: chunk[f] for f in ("stats", "argmax", "key")})
    return TokenScores(
        doc_id=np.array(["generation"] * len(prev), dtype=object), position=np.array(position, np.int32),
        prev=np.array(prev, np.int32), target=stats["argmax"], logp=stats["stats"][:, 0].copy(),
        max_logp=stats["stats"][:, 1].copy(), entropy=stats["stats"][:, 2].copy(), argmax=stats["argmax"].copy(),
        key=stats["key"])


def _choose(logp: torch.Tensor, cfg: GenerateConfig, rng: torch.Generator) -> torch.Tensor:
    """The top token at temperature 0; else a sample from the nucleus of the tempered distribution
    (a 0-d tensor on logp's device: nothing read)."""
    if cfg.temperature == 0:
        return logp.argmax()
    probs = torch.softmax(logp / cfg.temperature, dim=-1)
    order = probs.argsort(descending=True)
    sorted_p = probs[order]
    keep = sorted_p.cumsum(0) - sorted_p < cfg.top_p  # the smallest prefix reaching top_p
    nucleus = sorted_p * keep / (sorted_p * keep).sum()
    # torch.multinomial's own draw of one sample (argmax of p / q, q ~ Exp(1)) without its check of
    # the probabilities, an `.item()` that would make the host wait for the device each row and step
    return order.gather(0, (nucleus / torch.empty_like(nucleus).exponential_(1, generator=rng)).argmax().view(1))[0]


class Row:
    """One prompt's continuation in a Decoder: its tokens so far, and its Generation once it ended."""

    def __init__(self, prompt: str, ids: list[int], cfg: GenerateConfig, should_stop: Callable[[], str | None] | None,
                 device: torch.device):
        self.prompt, self.ids, self.cfg, self.should_stop = prompt, ids, cfg, should_stop
        self.rng = torch.Generator(device).manual_seed(cfg.seed)
        self.tokens: list[int] = []
        self.lams: list[float] = []  # per token: Θ's λ
        self.credit: list[dict[int, float]] = []  # per token: {memory entry id: the kNN weight it carried}
        self.logprobs: list[np.ndarray] = []  # per token, where the row keeps them: Θ's log P over the vocabulary
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


def _held(lm: LM, lengths: list[int], columns: int, q: int) -> torch.Tensor | None:
    """The attention mask of a pass over left-padded rows whose last `lengths` of `columns` cache
    columns are theirs (the q new tokens last): None without padding (causal attention), else the
    mask monim builds (`monim.lm.device`: nothing read), or the 2-D one transformers prepares."""
    if min(lengths) == columns:
        return None
    held = upload(np.arange(columns)[None, :] >= columns - np.array(lengths)[:, None], lm.device)
    return attention_mask(lm, held, q) if own_masks(lm) else held.long()


class Decoder:
    """Continuations decoded together: each step runs ONE LM forward (a left-padded KV cache, each
    row's own positions, the attention mask built by monim: `monim.lm.device`) and ONE memory search
    for every active row; Θ is mixed and the next tokens chosen on the LM's device, so the host reads
    once a step the chosen tokens with what each row keeps of the step (λ, credit, distributions:
    nothing of a step stays on the device; a memory searched on the host reads the step's statistics
    and log P too). A row added joins at the next step the batch has room for it (its prompt
    prefilled with those of its length joining then, its cache merged in) and leaves the batch when
    it ends; each row writes what it would write alone (to float32's precision: an LM in bfloat16 or
    float16 decodes one row at a time, their rounding would make a row's tokens depend on its batch)."""

    def __init__(self, lm: LM, memory: Memory | None = None, max_rows: int | None = None, max_cells: int = 32768,
                 on_device: OnDevice | None = None):
        self.max_rows = max_rows or (64 if lm.model.dtype == torch.float32 else 1)
        self.lm, self.memory, self.max_cells = lm, memory, max_cells
        self.searched = memory if memory is not None and memory.retrieves else None  # Θ's memory, searched each step
        if self.searched is not None:
            self.searched.sync()
        if on_device is None and self.searched is not None and self.searched.searched_on_device:
            on_device = self.searched.on_device()  # where its searches run in torch, as Memory.score does
        # the memory on the LM's device, if held there; given without `memory`, Θ is read from it alone (no sources)
        self.on_device = on_device if self.searched is not None or memory is None else None
        self.waiting: list[Row] = []  # added, prefilled once the batch has room (first come, first in)
        self.active: list[Row] = []  # in the batch, in the cache's row order
        self.cache, self.columns = self._empty()  # columns: the cache's; row r holds its last (r.length - 1)
        self.last = torch.zeros((0, 1), dtype=torch.long, device=lm.device)  # each active row's last token, on the device

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
        row = Row(prompt, ids, cfg, should_stop, self.lm.device)
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
        lm_logp = torch.log_softmax(self.lm.logits(torch.cat(hidden)), dim=-1)
        logp = lm_logp.double()
        lam, credit = torch.zeros(len(rows), dtype=torch.float64, device=self.lm.device), None
        if self.on_device is not None:
            logp, lam, credit = self._theta_on_device(self.on_device, rows, torch.cat(keys), lm_logp)
        elif self.searched is not None:
            logp, lam, credit = self._theta(self.searched, rows, torch.cat(keys), lm_logp)
        tokens = logp.argmax(dim=-1)
        for i, row in enumerate(rows):
            if row.cfg.temperature != 0:
                tokens[i] = _choose(logp[i], row.cfg, row.rng)
        self.last = tokens[:, None]
        record = dict(tokens=tokens, lam=lam)
        if credit is not None:  # the entries whose value is the chosen token carried its kNN weight
            match = (credit["values"] == tokens[:, None]) & (lam[:, None] > 0)
            record.update(ids=credit["ids"].masked_fill(~match, -1), weight=credit["weight"])
        keeping = [i for i, row in enumerate(rows) if row.cfg.keep_distributions]
        if keeping:
            record["logp"] = logp.index_select(0, upload(np.array(keeping), self.lm.device))
        read = to_host(record)  # the step's one read: the chosen tokens and what the rows keep, nothing left on the device
        kept = dict(zip(keeping, read.get("logp", ())))
        eos, ending = self.lm.tokenizer.eos_token_id, []
        for i, (row, token) in enumerate(zip(rows, read["tokens"].tolist())):
            row.lams.append(float(read["lam"][i]))
            row.credit.append({} if credit is None else
                              {int(read["ids"][i, j]): float(read["weight"][i, j]) for j in np.flatnonzero(read["ids"][i] >= 0)})
            if i in kept:
                row.logprobs.append(kept[i])
            row.tokens.append(token)
            if token == eos or len(row.tokens) == row.cfg.max_new_tokens:
                ending.append((row, "eos" if token == eos else "max_new_tokens"))
        self._end(ending)
        ended += [row for row, _ in ending]
        self._keep([r.result is None for r in rows])
        return ended

    def _theta(self, memory: Memory, rows: list[Row], keys: torch.Tensor,
               lm_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Θ's log P [n, V] of a step, each row's λ [n] and its neighbours (ids, values, the kNN weight each
        carried: λ times its weight), on the LM's device; the memory searched on the host: the step's
        statistics and the LM's log P read for it."""
        prev = [r.tokens[-1] if r.tokens else r.ids[-1] for r in rows]
        batch = _step_scores(_step(keys, lm_logp), prev, [r.length for r in rows])
        found = memory.search(batch)
        batch.knn_dist, batch.knn_values, batch.knn_ids, batch.knn_prior, batch.knn_skipped = found
        logp, lam, knn_w = memory.theta_logprobs(batch, torch.from_numpy(to_host(lm_logp)).double())
        device = self.lm.device
        lam_t = upload(lam, device)
        return logp.to(device), lam_t, {"ids": upload(found.ids, device), "values": upload(found.values.astype(np.int64), device),
                                        "weight": lam_t[:, None] * upload(knn_w, device)}

    def _theta_on_device(self, on: OnDevice, rows: list[Row], keys: torch.Tensor,
                         lm_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """`_theta` with the memory on the LM's device: each row's key searched there, λ by the rule and
        Θ's full distribution mixed there (knnlm.theta_logprobs, as ThetaRule's), nothing read."""
        chunk = _step(keys, lm_logp)
        chunk["prev"] = upload(np.array([r.tokens[-1] if r.tokens else r.ids[-1] for r in rows]), self.lm.device)
        chunk.update(on.search(chunk))
        lam = row_lam(chunk["knn_values"], on.lam(chunk))
        logp, logw = theta_logprobs(lm_logp.double(), chunk["knn_dist"], chunk["knn_values"], chunk.get("knn_prior"), lam,
                                    on.interpolation.temperature)
        return logp, lam, {"ids": chunk["knn_ids"], "values": chunk["knn_values"].long(), "weight": lam[:, None] * logw.exp()}

    def _room(self) -> list[Row]:
        """The first waiting rows the batch has room for: at most `max_rows` rows, and at most `max_cells`
        tokens in its padded cache (rows × the longest context; a first row always fits)."""
        rows, columns = len(self.active), self.columns
        for n, row in enumerate(self.waiting):
            rows, columns = rows + 1, max(columns, len(row.ids))
            if rows > 1 and (rows > self.max_rows or rows * columns > self.max_cells):
                return self.waiting[:n]
        return self.waiting

    def _stopped(self, row: Row) -> bool:
        """Whether the row's `should_stop` ends it before its next token (then it has its result)."""
        reason = row.should_stop() if row.should_stop is not None else None
        if reason:
            self._end([(row, reason)])
        return bool(reason)

    def _forward(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The batch's last tokens (on the device) through the LM in one pass: final hidden states and keys, [1, d] per row."""
        lengths = [r.length for r in self.active]
        self.columns += 1
        hidden, keys = self.lm.forward(self.last, attention_mask=_held(self.lm, lengths, self.columns, 1),
                                       position_ids=upload(np.array(lengths)[:, None] - 1, self.lm.device), past=self.cache)
        return list(hidden[:, -1:].unbind(0)), list(keys[:, -1:].unbind(0))

    def _prefill(self, rows: list[Row]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """New prompts through the LM in one pass (left-padded to the longest; a prompt alone as it is),
        their cache joined to the batch's: final hidden states and keys of their last tokens, [1, d] per row."""
        lengths = np.array([len(r.ids) for r in rows])
        longest, device = int(lengths.max()), self.lm.device
        ids = np.array([[0] * (longest - len(r.ids)) + r.ids for r in rows], np.int64)
        pos = np.maximum(np.arange(longest)[None, :] - (longest - lengths)[:, None], 0)
        cache = DynamicCache(config=self.lm.model.config)
        hidden, keys = self.lm.forward(upload(ids, device), attention_mask=_held(self.lm, lengths.tolist(), longest, longest),
                                       position_ids=upload(pos, device), past=cache)
        self._join(cache, longest)
        return list(hidden[:, -1:].unbind(0)), list(keys[:, -1:].unbind(0))

    def _join(self, cache: DynamicCache, columns: int) -> None:
        """Prefilled rows' cache (of `columns` columns) after the batch's rows: both left-padded to the longer."""
        if not self.active:
            self.cache, self.columns = cache, columns
            return
        columns = max(self.columns, columns)
        for (mine, my_keys, my_values), (_, their_keys, their_values) in zip(kv_layers(self.cache), kv_layers(cache)):
            held = max(my_keys.shape[-2], their_keys.shape[-2])  # a sliding-window layer holds its window only
            mine.keys, mine.values = (torch.cat([_pad_left(a, held - a.shape[-2]), _pad_left(b, held - b.shape[-2])])
                                      for a, b in ((my_keys, their_keys), (my_values, their_values)))
            if hasattr(mine, "cumulative_length"):
                mine.cumulative_length = columns
        self.columns = columns

    def _keep(self, keep: list[bool]) -> None:
        """Only these rows of the batch (the others ended), and no column that is padding in every row."""
        if all(keep):
            return
        self.active = [r for r, k in zip(self.active, keep) if k]
        if not self.active:
            self.cache, self.columns = self._empty()
            return
        index = upload(np.flatnonzero(keep), self.lm.device)
        self.last = self.last[index]
        columns = max(r.length - 1 for r in self.active)  # the leading columns no row uses dropped
        for layer, keys, values in kv_layers(self.cache):
            held = min(keys.shape[-2], columns)
            layer.keys, layer.values = (t[index, :, t.shape[-2] - held:] for t in (keys, values))
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = columns
        self.columns = columns

    def _empty(self) -> tuple[DynamicCache, int]:
        """The cache and its columns of a batch without rows."""
        return DynamicCache(config=self.lm.model.config), 0

    def _end(self, ending: list[tuple[Row, str]]) -> None:
        """Each ending row's Generation (why it stopped), with its sentences and their sources."""
        for row, stopped in ending:
            row.result = Generation(row.prompt, self.lm.decode(row.tokens, skip_special_tokens=True), row.tokens, row.lams,
                                    stopped=stopped, logprobs=row.logprobs if row.cfg.keep_distributions else None,
                                    sources=row.sources)
            row.result.sentences = sentences(self.lm, self.memory, row.tokens, row.credit, row.cfg.sources)


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

