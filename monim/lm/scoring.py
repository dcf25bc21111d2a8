"""Scoring token sequences with the LM: per-token statistics and keys, each token computed once.

Sequences that fit one step are packed several to a row (each sees only itself); longer ones run
step by step, `stride` new tokens at a time, with the previous step's keys and values carried as
a KV cache (`context_mode="carry"`, the paper's 512 + 512 windows without computing the context
twice), the whole document before them ("document"), or the paper's windows recomputed ("recompute").
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from contextvars import copy_context
from typing import Any, Callable, Generator, Iterable, Iterator

import numpy as np
import torch
from transformers import DynamicCache

from monim.core.config import ScoreConfig
from monim.data.feed import Document
from monim.lm.device import attention_mask, own_masks, upload
from monim.lm.host import queued, to_host
from monim.lm.model import LM, kv_layers
from monim.lm.token_scores import Found, Neighbors, OnDevice, TokenScores
from monim.lm.windows import DEVICE_BATCH, Sequence, Span, batching, fit_window, pack, plan

Pending = Callable[[], "TokenScores | None"]  # a pass's statistics, read from the device when called
SEARCHED = tuple(f.name for f in dataclasses.fields(TokenScores) if f.name.startswith(("knn_", "lm_logp_values", "theta_")))


@torch.inference_mode()
def _statistics(lm: LM, hidden: torch.Tensor, keys: torch.Tensor, picks: list[tuple[int, int, Span]],
                cfg: ScoreConfig, neighbors: Neighbors | OnDevice | None, keep_hidden: bool) -> Pending:
    """The kept outputs of a forward pass (`picks`: row, column of input `a`, span) as TokenScores.

    The vocabulary projection runs `cfg.head_chunk` rows at a time. Without `neighbors`, or with a
    memory searched on the device (OnDevice: each chunk's neighbours, the LM's log P of their values
    and Θ's scores computed there too), the whole pass's results stay on the device and are copied
    to the host at once, queued behind the pass (one read): the caller queues the next pass before
    reading them, so the GPU never waits for the host (a second read only where the skip kept more
    rows of a chunk than were searched in full: `_completed`). With host `neighbors`, each chunk's LM
    statistics are read before its neighbours are searched (so a retriever can decide to skip rows)."""
    host, at = _provenance(picks)
    rows, cols = (upload(a, lm.device) for a in at)
    hidden, keys = hidden[rows, cols], keys[rows, cols]
    target = upload(host["target"].astype(np.int64), lm.device)
    prev = upload(host["prev"].astype(np.int64), lm.device) if isinstance(neighbors, OnDevice) else None  # the calibrator reads them
    _, head_chunk = batching(cfg)
    parts: list[TokenScores] = []  # with host neighbours: each chunk read to the host
    chunks: list[dict[str, torch.Tensor]] = []  # else: each chunk's results, still on the device
    for i in range(0, len(host["target"]), head_chunk):
        sl = slice(i, i + head_chunk)
        logits = lm.logits(hidden[sl])
        stats, argmax, lse = _lm_stats(logits, target[sl])
        chunk = dict(stats=stats, argmax=argmax, key=keys[sl].to(torch.float16))
        if keep_hidden:
            chunk["hidden"] = hidden[sl].float()
        if isinstance(neighbors, OnDevice):
            assert prev is not None
            inputs = chunk | dict(target=target[sl], prev=prev[sl])
            chunks.append(chunk | _theta_chunk(neighbors, inputs, logits, lse, neighbors.rows(len(stats))))
        elif neighbors is not None:
            part = _scores({f: v[sl] for f, v in host.items()}, to_host(chunk))
            _search(lm, part, logits, lse, neighbors)
            parts.append(part)
        else:
            chunks.append(chunk)
    if parts:
        return lambda: TokenScores.concat(parts)
    if not chunks:
        return lambda: None
    every = {f: torch.cat([c[f] for c in chunks]) for f in chunks[0]}
    read = queued(every)
    if not isinstance(neighbors, OnDevice):
        return lambda: _scores(host, read())
    on_device, lm_stats = neighbors, {f: every[f] for f in ("stats", "argmax", "key")}  # (not the neighbours: let go)

    def again(sl: slice) -> dict[str, torch.Tensor]:
        """A chunk searched again, every kept row in full (its logits made again: the same numbers)."""
        assert prev is not None
        inputs = {f: t[sl] for f, t in lm_stats.items()} | dict(target=target[sl], prev=prev[sl])
        logits = lm.logits(hidden[sl])
        return _theta_chunk(on_device, inputs, logits, _lm_stats(logits, target[sl])[2], len(logits))

    return lambda: _scores(host, _completed(on_device, read(), head_chunk, again))


def _lm_stats(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's LM statistics from its logits: stats [n, 3] (log P(target), max log P, entropy), the top token (int32), log Z."""
    top = logits.max(dim=-1)
    shifted = logits - top.values[:, None]
    exp = shifted.exp()
    total = exp.sum(dim=-1)
    log_total = total.log()
    lse = top.values + log_total
    stats = torch.stack([logits.gather(1, target[:, None])[:, 0] - lse, -log_total,
                         log_total - (exp * shifted).sum(dim=-1) / total], dim=1)
    return stats, top.indices.to(torch.int32), lse


def _theta_chunk(on_device: OnDevice, inputs: dict[str, torch.Tensor], logits: torch.Tensor, lse: torch.Tensor,
                 rows: int | None) -> dict[str, torch.Tensor]:
    """A chunk searched on the device (`rows` of it in full: OnDevice.search) and Θ's scores: what the host reads of it (`_kept`)."""
    found = on_device.search(inputs, rows)
    found["lm_logp_values"] = _values_logp(logits, lse, found["knn_values"])
    return _kept(on_device, found) | on_device.theta(inputs | found)


def _completed(on_device: OnDevice, read: dict[str, np.ndarray], chunk: int,
               again: Callable[[slice], dict[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    """A pass's results read from the device, its chunks whose kept rows outgrew the rows searched in
    full (`knn_missed`) searched `again` and read (a second read, only then); the next `rows` sized."""
    if "knn_skipped" in read:
        on_device.saw(read["knn_skipped"], chunk)
    missed = read.pop("knn_missed", None)
    if missed is None:
        return read
    redo = [slice(i, i + chunk) for i in range(0, len(missed), chunk) if missed[i : i + chunk].any()]
    if redo:
        parts = [again(sl) for sl in redo]
        got = to_host({f: torch.cat([p[f] for p in parts]) for f in parts[0] if f in read})
        at = np.concatenate([np.arange(len(missed))[sl] for sl in redo])
        for f, v in got.items():
            read[f][at] = v
    return read


def _provenance(picks: list[tuple[int, int, Span]]) -> tuple[dict[str, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The host-side fields of a pass's kept outputs (doc_id, position, prev, target) and where they sit
    in its outputs (row, column), built with array operations (one step per span, none per token)."""
    n = np.array([sp.e - sp.keep for _, _, sp in picks], np.int64)
    first = np.cumsum(n) - n
    within = np.arange(n.sum()) - np.repeat(first, n)  # each kept output's place in its span
    row = np.repeat(np.array([b for b, _, _ in picks], np.int64), n)
    col = np.repeat(np.array([c + sp.keep - sp.a for _, c, sp in picks], np.int64), n) + within
    toks = [np.asarray(sp.toks[sp.keep : sp.e + 1], np.int32) for _, _, sp in picks]
    empty = np.zeros(0, np.int32)
    host = dict(doc_id=np.repeat(np.array([sp.seq_id for _, _, sp in picks], dtype=object), n),
                position=(np.repeat(np.array([sp.keep + 1 for _, _, sp in picks], np.int64), n) + within).astype(np.int32),
                prev=np.concatenate([t[:-1] for t in toks] or [empty]), target=np.concatenate([t[1:] for t in toks] or [empty]))
    return host, (row, col)


def _scores(host: dict[str, np.ndarray], found: dict[str, np.ndarray]) -> TokenScores:
    """TokenScores from a pass's host-side fields and what it read from the device (`stats`, `argmax`,
    `key`; `hidden` where kept; the neighbours' and Θ's fields where searched on the device)."""
    floats = found["stats"]
    return TokenScores(**host, logp=floats[:, 0].copy(), max_logp=floats[:, 1].copy(), entropy=floats[:, 2].copy(),
                       **{f: v for f, v in found.items() if f != "stats"})


def _kept(on_device: OnDevice, found: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the host reads of a chunk's neighbours: all of them, or (`read_neighbors` off) which tokens were skipped (and missed)."""
    return found if on_device.read_neighbors else {f: found[f] for f in ("knn_skipped", "knn_missed") if f in found}


def _values_logp(logits: torch.Tensor, lse: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The LM's log P of each neighbour's value [n, k] (a missing neighbour's: token 0's), from a chunk's logits."""
    return logits.gather(1, values.long().clamp(min=0)) - lse[:, None]


def _search(lm: LM, part: TokenScores, logits: torch.Tensor, lse: torch.Tensor, neighbors: Neighbors) -> None:
    """Fill a chunk's neighbours and the LM's log P of each neighbour's value (logits: the chunk's)."""
    part.knn_dist, part.knn_values, part.knn_ids, part.knn_prior, part.knn_skipped = neighbors(part)
    part.lm_logp_values = to_host(_values_logp(logits, lse, torch.from_numpy(part.knn_values).to(lm.device)))


def _nothing() -> None:
    """No pass queued: before the first pass, and behind the last."""


def _ready(queued: Pending, new: Pending) -> Generator[TokenScores, None, Pending]:
    """Yield the previous pass's scores once the next pass is queued behind them; the next becomes the queued one."""
    if (scores := queued()) is not None:
        yield scores
    return new


def _pad_id(lm: LM) -> int:
    return lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0


@torch.inference_mode()
def _packed(lm: LM, spans: list[Span], cfg: ScoreConfig, neighbors: Neighbors | OnDevice | None,
            keep_hidden: bool) -> Iterator[TokenScores]:
    """Independent spans packed into rows (monim.lm.windows.pack), `batch_size` rows per forward pass;
    positions restart at each span, so each sees only itself."""
    rows, (per_pass, _) = pack(spans, cfg), batching(cfg)
    queued: Pending = _nothing
    for i in range(0, len(rows), per_pass):
        batch = rows[i : i + per_pass]
        width = max(sum(s.e - s.a for s in row) for row in batch)
        ids = np.full((len(batch), width), _pad_id(lm), dtype=np.int64)
        pos = np.zeros((len(batch), width), dtype=np.int64)
        segment = np.zeros((len(batch), width), dtype=np.int64)  # each span's own number in its row; padding another
        picks = []
        for b, row in enumerate(batch):
            c = 0
            for n, sp in enumerate(row):
                ids[b, c : c + sp.e - sp.a] = sp.toks[sp.a : sp.e]
                pos[b, c : c + sp.e - sp.a] = np.arange(sp.e - sp.a)
                segment[b, c : c + sp.e - sp.a] = n
                picks.append((b, c, sp))
                c += sp.e - sp.a
            pos[b, c:] = np.arange(width - c)  # padding: a sequence of its own
            segment[b, c:] = len(row)
        mask, cache = None, None  # without monim's masks, transformers finds the spans from the positions
        if own_masks(lm) and all(len(row) == 1 and row[0].e - row[0].a == width for row in batch):
            # one span a row, no padding: plain causal attention (a GPU's flash kernel); a cache that keeps
            # nothing keeps transformers from testing the positions for packed sequences
            cache = lm.passing
        elif own_masks(lm):
            held = torch.ones((len(batch), width), dtype=torch.bool, device=lm.device)
            mask = attention_mask(lm, held, width, upload(segment, lm.device))
        hidden, keys = lm.forward(upload(ids, lm.device), mask, upload(pos, lm.device), cache)
        queued = yield from _ready(queued, _statistics(lm, hidden, keys, picks, cfg, neighbors, keep_hidden))
    yield from _ready(queued, _nothing)


@torch.inference_mode()
def _stepped(lm: LM, docs: list[list[Span]], cfg: ScoreConfig, neighbors: Neighbors | OnDevice | None,
             keep_hidden: bool) -> Iterator[TokenScores]:
    """Sequences with the same first step in lockstep, longest first (later steps are `stride` long,
    a last one shorter: a sequence that ends leaves the batch), the previous steps' keys and values
    kept as a KV cache: under carry, the last `context` of them and the first
    `sink` (without the first tokens, which soak up attention, the model's predictions collapse:
    PPL 33 instead of 21 on real news; "attention sinks", Xiao et al. 2023)."""
    limit = getattr(lm.model.config, "max_position_embeddings", None) or 1 << 30
    sink = min(cfg.sink, cfg.stride)
    keep = cfg.context if cfg.context_mode == "carry" else limit - cfg.stride - sink
    cache, past = DynamicCache(config=lm.model.config), np.zeros((len(docs), 0), dtype=bool)
    origin = np.array([steps[0].a for steps in docs])
    queued: Pending = _nothing
    for j in range(len(docs[0])):
        step = [steps[j] for steps in docs]
        lengths = np.array([sp.e - sp.a for sp in step])
        width = int(lengths.max())
        ids = np.full((len(docs), width), _pad_id(lm), dtype=np.int64)
        for b, sp in enumerate(step):
            ids[b, : sp.e - sp.a] = sp.toks[sp.a : sp.e]
        pos = (np.array([sp.a for sp in step]) - origin)[:, None] + np.arange(width)
        past = np.concatenate([past, np.arange(width) < lengths[:, None]], axis=1)
        mask = None  # no padding held: transformers' causal mask, which needs no read
        if not past.all():
            held = upload(past, lm.device)
            mask = attention_mask(lm, held, width) if own_masks(lm) else held.long()
        hidden, keys = lm.forward(upload(ids, lm.device), mask, upload(pos, lm.device), cache)
        queued = yield from _ready(queued, _statistics(lm, hidden, keys, [(b, 0, sp) for b, sp in enumerate(step)],
                                                        cfg, neighbors, keep_hidden))
        live = [b for b, steps in enumerate(docs) if len(steps) > j + 1]
        if len(live) < len(docs):
            docs, origin, past = [docs[b] for b in live], origin[live], past[live]
            cache.batch_select_indices(upload(np.array(live, np.int64), lm.device))
        if past.shape[1] > sink + keep:
            for layer, held_keys, held_values in kv_layers(cache):
                layer.keys = torch.cat([held_keys[:, :, :sink], held_keys[:, :, -keep:]], dim=2)
                layer.values = torch.cat([held_values[:, :, :sink], held_values[:, :, -keep:]], dim=2)
            past = np.concatenate([past[:, :sink], past[:, -keep:]], axis=1)
    yield from _ready(queued, _nothing)


def _plan(lm: LM, seqs: list[Sequence], cfg: ScoreConfig, neighbors: Neighbors | OnDevice | None,
          keep_hidden: bool) -> Iterator[TokenScores]:
    """Score a buffer of sequences: one-step spans packed, longer sequences stepped in lockstep
    batches of equal first steps."""
    (single, stepped), (per_pass, _) = plan(seqs, cfg), batching(cfg)
    if single:
        yield from _packed(lm, single, cfg, neighbors, keep_hidden)
    for group in stepped:
        for i in range(0, len(group), per_pass):
            yield from _stepped(lm, group[i : i + per_pass], cfg, neighbors, keep_hidden)


def score_tokens(lm: LM, sequences: Iterable[Sequence], cfg: ScoreConfig | None = None,
                 neighbors: Neighbors | OnDevice | None = None, keep_hidden: bool = False,
                 buffer_tokens: int | None = None) -> Iterator[TokenScores]:
    """Score token sequences (id, token ids, first target position) like `score`; sequences are
    planned `buffer_tokens` at a time (None: the device's; memory stays bounded), so batches need not
    follow their order."""
    cfg = fit_window(lm, cfg or ScoreConfig())
    buffer_tokens = buffer_tokens or DEVICE_BATCH.get(lm.device.type, DEVICE_BATCH["cpu"])[2]
    buffer: list[Sequence] = []
    size = 0
    for seq in sequences:
        buffer.append(seq)
        size += len(seq[1])
        if size >= buffer_tokens:
            yield from _plan(lm, buffer, cfg, neighbors, keep_hidden)
            buffer, size = [], 0
    if buffer:
        yield from _plan(lm, buffer, cfg, neighbors, keep_hidden)


def score(lm: LM, docs: Iterable[Document], cfg: ScoreConfig | None = None,
          neighbors: Neighbors | OnDevice | None = None, keep_hidden: bool = False) -> Iterator[TokenScores]:
    """Score documents, batched; memory stays bounded by one buffer.

    With `neighbors` (a memory's search, or a memory on the LM's device: OnDevice), each token also
    carries its nearest entries (on the device: and its scores under Θ); with
    `keep_hidden`, its final hidden state (to search other memories later: `with_neighbors`).
    """
    sequences = ((doc.id, lm.tokenizer(doc.text)["input_ids"], 1) for doc in docs)
    return score_tokens(lm, sequences, cfg, neighbors, keep_hidden)


@torch.inference_mode()
def with_neighbors(lm: LM, batch: TokenScores, neighbors: Neighbors | OnDevice, chunk: int = 1024,
                   at_once: int = 1) -> TokenScores:
    """A copy of a batch scored with keep_hidden, searched in another memory (the LM is not re-run);
    `at_once`: chunks searched together (a memory spread over that many workers); a memory on the
    LM's device (OnDevice): `_on_device`.

    The LM's log P of each neighbour's value needs the logits of those values only: the hidden
    states against the output layer's rows of the values met in the chunk, less the log
    normalizer, which the stored log P of the target gives (logit(target) - log P(target))."""
    if batch.hidden is None:
        raise ValueError("with_neighbors needs batches scored with keep_hidden=True")
    if isinstance(neighbors, OnDevice):
        return _on_device(lm, batch, neighbors, chunk)
    parts = [batch.select(slice(i, i + chunk)) for i in range(0, len(batch), chunk)]
    for part, found in zip(parts, _searched(neighbors, parts, at_once)):
        part.knn_dist, part.knn_values, part.knn_ids, part.knn_prior, part.knn_skipped = found
        hidden = torch.from_numpy(part.hidden).to(lm.device, lm.model.dtype)
        met, at = torch.unique(torch.from_numpy(np.concatenate([part.target[:, None], part.knn_values], 1)).long()
                               .clamp(min=0).to(lm.device), return_inverse=True)
        logits = lm.logits_of(hidden, met).gather(1, at)  # [n, 1 + k]: the target's, then each neighbour's value's
        lse = logits[:, 0] - torch.from_numpy(part.logp).to(lm.device)
        part.lm_logp_values = (logits[:, 1:] - lse[:, None]).cpu().numpy()
    return TokenScores.concat(parts)


def _on_device(lm: LM, batch: TokenScores, neighbors: OnDevice, chunk: int) -> TokenScores:
    """with_neighbors with the memory on the LM's device: each chunk's neighbours, the LM's log P of
    their values (from the chunk's full logits: the values met are not known to the host) and Θ's
    scores computed there, and the whole batch's read at once."""
    assert batch.hidden is not None
    every = {f: upload(getattr(batch, f), lm.device) for f in ("key", "argmax", "target", "prev")}
    every["stats"] = upload(np.stack([batch.logp, batch.max_logp, batch.entropy], 1), lm.device)
    hidden = upload(batch.hidden, lm.device).to(lm.model.dtype)  # all copied up before any work is queued

    def searched(sl: slice, rows: int | None) -> dict[str, torch.Tensor]:
        inputs = {f: t[sl] for f, t in every.items()}
        logits = lm.logits(hidden[sl])
        lse = logits.gather(1, inputs["target"].long()[:, None])[:, 0] - inputs["stats"][:, 0]
        return _theta_chunk(neighbors, inputs, logits, lse, rows)

    rows = [min(chunk, len(batch) - i) for i in range(0, len(batch), chunk)]
    out = [searched(slice(i * chunk, i * chunk + n), neighbors.rows(n)) for i, n in enumerate(rows)]
    read = to_host({f: torch.cat([o[f] for o in out]) for f in out[0]}) if out else {}
    read = _completed(neighbors, read, chunk, lambda sl: searched(sl, sl.stop - sl.start))
    searched_now: dict[str, Any] = dict.fromkeys(SEARCHED) | read  # nothing left of an earlier search
    return dataclasses.replace(batch, **searched_now)


def _searched(neighbors: Neighbors, parts: list[TokenScores], at_once: int) -> list[Found]:
    """Each chunk's neighbours, `at_once` searched together: a spread memory's workers answer them side by side."""
    if at_once <= 1 or len(parts) <= 1:
        return [neighbors(p) for p in parts]
    with ThreadPoolExecutor(min(at_once, len(parts))) as pool:  # each call in the caller's context (a stage's name)
        return list(pool.map(lambda part, context: context.run(neighbors, part), parts, [copy_context() for _ in parts]))
