"""Serving Θ to many callers: requests checked against documented limits (each refusal names the
field and the limit), one worker thread that alone runs Θ (concurrent texts are scored together in
one LM pass, concurrent prompts decoded together, a token of each a step), and work bounded in time:
a request that waits or runs past its budget, or whose caller is gone, stops and says so. Another Θ,
loaded whole elsewhere, is swapped in by the worker between requests: every request is answered by one Θ.

A request is MLflow's scoring format, in any of its four forms (`parse`): rows {"text": ...} or
{"prompt": ...} under "dataframe_records", "dataframe_split", "inputs" or "instances", and
"params": {"max_new_tokens", "temperature", "top_p", "seed", "sources"}. A `text` row gets Θ's
perplexity (and the LM's alone), a `prompt` row a continuation with λ per token and sources.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import queue
import re
import reprlib
import threading
import time
from dataclasses import dataclass, field, fields, replace
from typing import Callable

import numpy as np

from monim.evaluation.evaluate import score_texts
from monim.serving.generate import Decoder, GenerateConfig, Row
from monim.theta.memory import Memory
from monim.data.sources import Document

log = logging.getLogger(__name__)
ROW_FIELDS = ("text", "prompt")


@dataclass(frozen=True)
class Limits:
    """What one request may ask (the server's defaults, documented in the README)."""

    max_rows: int = 32  # rows per request
    max_chars: int = 20_000  # characters per text or prompt
    max_new_tokens: int = 256  # tokens a prompt may ask for
    seconds: float = 60.0  # per request, waiting included: a continuation stops there and answers with what it wrote
    max_body_bytes: int | None = None  # bytes a body may hold; None: room for max_rows rows of max_chars characters
    max_depth: int = 32  # how deep a body's JSON may nest (a request needs 4)

    def __post_init__(self) -> None:
        if self.max_body_bytes is None:  # 12 bytes a character: an escaped surrogate pair; 64 KiB for the rest
            object.__setattr__(self, "max_body_bytes", 12 * self.max_chars * self.max_rows + 65_536)


class BadRequest(ValueError):
    """A request monim will not answer: the message names the field (and the limit)."""


class Busy(RuntimeError):
    """The request waited past its time budget before Θ was free (answered 503: try again)."""


@dataclass
class Request:
    """A checked request: its rows as (field, value), each row's field as the body named it, and how
    prompts are continued."""

    rows: list[tuple[str, str]]
    generation: GenerateConfig
    retrieve: frozenset[int] = frozenset()  # the prompt rows asking for the best article before them ("retrieve": true)
    named: list[str] = field(default_factory=list)  # each row's text or prompt as the body names it, for refusals


FORMATS = ("dataframe_split", "dataframe_records", "inputs", "instances")  # MLflow's scoring formats
STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string, escapes included
SHORT = reprlib.Repr()  # a value as a refusal quotes it: cut short
SHORT.maxstring = SHORT.maxother = 80
NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def loads(raw: bytes, limits: Limits) -> object:
    """A body's JSON, or a BadRequest where it is not JSON or nests deeper than the limit (counted
    on its brackets outside strings before parsing: Python's json recurses once a level)."""
    brackets = np.frombuffer(STRING.sub(b"", raw).translate(None, NOT_BRACKETS), np.uint8)
    depth = int(np.cumsum(np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1), dtype=np.int32).max(initial=0))
    if depth > limits.max_depth:
        raise BadRequest(f"the body nests {depth} levels deep; at most {limits.max_depth}")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise BadRequest(f"the body is not JSON: {e}") from None


def _param(name: str, value, kind: type):
    """A param of the right type, or a BadRequest naming it (a bool is no number; sources takes either)."""
    if name == "sources" and isinstance(value, bool):
        return 3 if value else 0
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and (kind is float or isinstance(value, int) or value.is_integer())):
        raise BadRequest(f"params.{name}: expected {'a whole number' if kind is int else 'a number'}"
                         f"{' or true/false' if name == 'sources' else ''}, got {SHORT.repr(value)}")
    try:
        return kind(value)
    except OverflowError:
        raise BadRequest(f"params.{name}: {SHORT.repr(value)} is too large") from None


def parse(body: object, limits: Limits) -> Request:
    """A request body in any of MLflow's four formats checked against the limits; unknown fields and
    params are refused by name, and every refusal names the field as the body does."""
    if not isinstance(body, dict):
        raise BadRequest("send a JSON object: {\"dataframe_records\": [{\"text\": ...} or {\"prompt\": ...}], "
                         "\"params\": {...}} (or MLflow's dataframe_split, inputs, instances)")
    unknown = sorted(set(body) - {*FORMATS, "params"}, key=str)
    if unknown:
        raise BadRequest(f"unknown field{'s' * (len(unknown) > 1)} {', '.join(map(SHORT.repr, unknown))}: send one of "
                         f"{', '.join(map(repr, FORMATS))} (and optionally 'params')")
    given = [f for f in FORMATS if f in body]
    if len(given) != 1:
        raise BadRequest(f"send exactly one of {', '.join(map(repr, FORMATS))}, got {given or 'none'}")
    rows = [_row(record, at, limits) for record, at in records(given[0], body[given[0]], limits)]
    params = body.get("params")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise BadRequest(f"params: expected an object, got {type(params).__name__}")
    kinds = {f.name: f.type for f in fields(GenerateConfig) if f.name not in ("keep_distributions", "retrieve")}
    unknown = sorted(set(params) - set(kinds), key=str)
    if unknown:
        raise BadRequest(f"params: unknown {', '.join(map(SHORT.repr, unknown))}; known: {', '.join(kinds)}")
    values = {k: _param(k, v, float if kinds[k] in ("float", float) else int) for k, v in params.items()}
    values.setdefault("max_new_tokens", min(GenerateConfig.max_new_tokens, limits.max_new_tokens))  # a server's lower limit
    if values["max_new_tokens"] > limits.max_new_tokens:
        raise BadRequest(f"params.max_new_tokens: {values['max_new_tokens']}; at most {limits.max_new_tokens}")
    try:
        generation = GenerateConfig(**values)
    except ValueError as e:
        raise BadRequest(f"params: {e}"[:300]) from None
    return Request([(name, value) for name, value, _, _ in rows], generation,
                   frozenset(i for i, (_, _, retrieve, _) in enumerate(rows) if retrieve), [n for *_, n in rows])


def records(form: str, data: object, limits: Limits) -> list[tuple[object, tuple[str, str]]]:
    """The rows of a body's `form` field as MLflow's scoring server reads them into a DataFrame, each
    with where it is in the body ((before, after) a column's name): `dataframe_records` and a list
    under `inputs` or `instances` hold one object a row, a dict under them one list a column (or
    one value a column: one row), `dataframe_split` pandas' `to_dict(orient="split")`."""
    if form == "dataframe_split":
        return _split(data, limits)
    if isinstance(data, dict) and form != "dataframe_records":
        return _columns(form, data, limits)
    if not isinstance(data, list) or not data:
        raise BadRequest(f"{form}: send a list of one or more rows, each {{\"text\": ...}} (to score) or "
                         f"{{\"prompt\": ...}} (to continue){'' if form == 'dataframe_records' else ', or an object of columns'}")
    _count(form, len(data), limits)
    return [(r, (f"{form}[{i}]", "")) for i, r in enumerate(data)]


def _count(where: str, n: int, limits: Limits) -> None:
    if n > limits.max_rows:
        raise BadRequest(f"{where}: {n} rows; at most {limits.max_rows} a request")


def _columns(form: str, data: dict, limits: Limits) -> list[tuple[object, tuple[str, str]]]:
    """A dict of columns, each a list of one value a row (or each a single value: one row)."""
    lists = {isinstance(v, list) for v in data.values()}
    if lists == {False}:
        return [(data, (form, ""))]
    lengths = {len(v) for v in data.values() if isinstance(v, list)}
    if lists != {True} or len(lengths) != 1 or 0 in lengths:
        raise BadRequest(f"{form}: give every column as a list of one value a row, all of the same length (or every "
                         f"column as one value), got {', '.join(f'{k!r}: {_shape(v)}' for k, v in data.items())}"[:300])
    (n,) = lengths
    _count(form, n, limits)
    return [({k: v[i] for k, v in data.items()}, (form, f"[{i}]")) for i in range(n)]


def _shape(value: object) -> str:
    return f"{len(value)} value{'s' * (len(value) != 1)}" if isinstance(value, list) else "one value"


def _split(data: object, limits: Limits) -> list[tuple[object, tuple[str, str]]]:
    """pandas' split orient: {"columns": [names], "data": [[a value a column], ...], "index": [labels]?}."""
    shape = 'send {"columns": ["text"], "data": [["..."], ...]} (pandas\' to_dict(orient="split"))'
    if not isinstance(data, dict):
        raise BadRequest(f"dataframe_split: {shape}, got {type(data).__name__}")
    unknown = sorted(set(data) - {"columns", "data", "index"}, key=str)
    if unknown:
        raise BadRequest(f"dataframe_split: unknown field {', '.join(map(SHORT.repr, unknown))}; {shape}")
    columns, rows, index = data.get("columns"), data.get("data"), data.get("index")
    if not isinstance(columns, list) or not columns or not all(isinstance(c, str) for c in columns):
        raise BadRequest(f"dataframe_split.columns: send the column names, e.g. [\"text\"], got {SHORT.repr(columns)}")
    if len(set(columns)) != len(columns):
        raise BadRequest(f"dataframe_split.columns: a column named twice in {SHORT.repr(columns)}")
    if not isinstance(rows, list) or not rows:
        raise BadRequest(f"dataframe_split.data: send a list of one or more rows, each a list of one value a column")
    _count("dataframe_split.data", len(rows), limits)
    if index is not None and not (isinstance(index, list) and len(index) == len(rows)):
        raise BadRequest(f"dataframe_split.index: one label a row ({len(rows)}), got {SHORT.repr(index)}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, list):
            row = [row] if len(columns) == 1 else row  # one column: pandas takes a value a row
        if not isinstance(row, list) or len(row) != len(columns):
            raise BadRequest(f"dataframe_split.data[{i}]: expected a list of {len(columns)} value"
                             f"{'s' * (len(columns) > 1)}, one a column, got {SHORT.repr(row)}")
        out.append((dict(zip(columns, row)), (f"dataframe_split.data[{i}]", "")))
    return out


def _missing(value: object) -> bool:
    """A DataFrame's empty cell: null, or NaN (pandas' missing value)."""
    return value is None or isinstance(value, float) and value != value


def _row(row: object, at: tuple[str, str], limits: Limits) -> tuple[str, str, bool, str]:
    """A row checked: (its field, its text, whether it asks to retrieve, the field as the body names it)."""
    before, after = at
    if not isinstance(row, dict):
        raise BadRequest(f"{before}{after}: expected an object with 'text' or 'prompt', got {type(row).__name__}")
    unknown = sorted(set(row) - {*ROW_FIELDS, "retrieve"}, key=str)
    given = {k: v for k, v in row.items() if k in ROW_FIELDS and not _missing(v)}
    if unknown or len(given) != 1:
        what = f"unknown field {', '.join(map(SHORT.repr, unknown))}" if unknown else f"got {sorted(given) or 'nothing'}"
        raise BadRequest(f"{before}{after}: give exactly one of 'text' (to score) or 'prompt' (to continue); {what}")
    (name, value), = given.items()
    named = f"{before}.{name}{after}"
    retrieve = False if _missing(row.get("retrieve")) else row["retrieve"]
    if not isinstance(retrieve, bool) or retrieve and name != "prompt":
        raise BadRequest(f"{before}.retrieve{after}: true or false, on a 'prompt' row (a text is scored as the model "
                         f"reads it), got {SHORT.repr(retrieve)}")
    if not isinstance(value, str) or not value.strip():
        raise BadRequest(f"{named}: expected non-empty text, got {SHORT.repr(value)}")
    if len(value) > limits.max_chars:
        raise BadRequest(f"{named}: {len(value)} characters; at most {limits.max_chars}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON's "\ud800": no character, no token
        raise BadRequest(f"{named}: a lone surrogate {value[e.start]!r} at character {e.start}: not Unicode text") from None
    return name, value, retrieve, named


@dataclass
class _Job:
    """One request waiting for Θ: its rows, when it must be done, and whether its caller is still there."""

    request: Request
    deadline: float
    cancelled: Callable[[], bool]
    answers: list = field(default_factory=list)
    rows: list[tuple[int, Row]] = field(default_factory=list)  # (row index, its continuation)
    error: Exception | None = None
    done: threading.Event = field(default_factory=threading.Event)


_WAKE = object()  # queued by a swap: the worker installs the new Θ even when no request comes


def now() -> str:
    """The wall-clock time, as /health shows it."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class Service:
    """Θ (one memory as of a day) answering requests from any number of threads, on one worker;
    `about` says what is served (shown by /health, with since when)."""

    def __init__(self, memory: Memory, limits: Limits | None = None, clock: Callable[[], float] = time.monotonic,
                 about: dict | None = None):
        self.memory, self.limits, self.clock = memory, limits or Limits(), clock
        self.about = dict(about or {}) | {"served_since": now()}
        self.failing: str | None = None  # the last request's failure, until one is answered again
        self._next: tuple[Memory, dict] | None = None
        self._swapping = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="monim-theta", daemon=True)
        self._stopping = False
        self._worker.start()

    def swap(self, memory: Memory, about: dict) -> None:
        """Answer new requests with `memory` (already loaded whole); the continuations in flight end on the Θ they began with."""
        with self._swapping:
            self._next = (memory, about)
        self._queue.put(_WAKE)

    def _install(self) -> bool:
        """Make the Θ handed to swap() the one that answers new requests; whether there was one."""
        with self._swapping:
            nxt, self._next = self._next, None
        if nxt is None:
            return False
        self.memory, self.about, self.failing = nxt[0], dict(nxt[1]) | {"served_since": now()}, None
        log.warning("now serving %s", ", ".join(f"{k} {v}" for k, v in nxt[1].items()))
        return True

    def answer(self, body: object, cancelled: Callable[[], bool] = lambda: False) -> list[dict]:
        """The answers to a request body, in row order (BadRequest, Busy, or the failure, raised)."""
        request = parse(body, self.limits)
        if self._stopping:
            raise Busy("the server is stopping")
        job = _Job(request, self.clock() + self.limits.seconds, cancelled)
        self._queue.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.answers

    def stop(self) -> None:
        """From now on: in-flight continuations stop at their next token, new and waiting requests are refused."""
        self._stopping = True

    def close(self) -> None:
        """Stop, and end the worker."""
        self.stop()
        self._queue.put(None)
        self._worker.join(timeout=30)

    def _run(self) -> None:
        """The worker: between decoding steps it takes the requests that arrived (their texts scored
        together, their prompts joining the continuations in flight), then advances every continuation
        by one token and answers the requests whose rows are all done. A new Θ answers the requests
        that arrive after its swap on a decoder of its own, while the continuations in flight end on
        the old one's: every request is answered by one Θ, and none waits for a swap."""
        decoders, running, closing = [Decoder(self.memory.lm, self.memory)], [], False  # running: (job, its decoder)
        while not (closing and not running):
            taken = [self._queue.get()] if not running else []
            while not self._queue.empty():
                taken.append(self._queue.get())
            closing |= None in taken
            jobs = [j for j in taken if isinstance(j, _Job)]
            if self._install():
                decoders.append(Decoder(self.memory.lm, self.memory))
            if closing:
                for j in jobs:
                    self._finish(j, self._busy("server stopping"))
            else:
                running += [(j, decoders[-1]) for j in self._start(jobs, decoders[-1])]
            for j, _ in [(j, d) for j, d in running if all(r.result for _, r in j.rows)]:
                self._answer(j)
            running = [(j, d) for j, d in running if not j.done.is_set()]
            decoders = [d for d in decoders[:-1] if len(d)] + decoders[-1:]  # an old Θ's decoder, once drained, goes
            for n, decoder in enumerate(decoders):
                try:
                    decoder.step()
                except Exception as e:  # noqa: BLE001 (every continuation of this decoder failed with it)
                    log.exception("generation failed")
                    for j, d in running:
                        if d is decoder:
                            self._finish(j, e)
                    running = [(j, d) for j, d in running if d is not decoder]
                    decoders[n] = Decoder(decoder.lm, decoder.memory)

    def _start(self, jobs: list[_Job], decoder: Decoder) -> list[_Job]:
        """The requests still wanted and within their budget, their texts scored in one pass and their
        prompts added to the decoder; the others refused."""
        live = []
        for j in jobs:
            if j.cancelled():
                log.warning("a request was dropped before it ran: the caller is gone")
                self._finish(j, self._busy("caller gone"))
            elif self._stopping:
                self._finish(j, self._busy("server stopping"))
            elif self.clock() > j.deadline:
                self._finish(j, self._busy("time limit"))
            else:
                live.append(j)
        try:
            self._score(live)
        except Exception as e:  # noqa: BLE001 (the trace is logged; the callers get the message)
            log.exception("scoring failed")
            for j in live:
                self._finish(j, e)
            return []
        for j in live:
            self._continue(j, decoder)
        return live

    def _score(self, jobs: list[_Job]) -> None:
        """Every text row of these requests, scored in one pass of the LM."""
        docs = {(n, i): Document(f"{n}/{i}", dt.date.min, value) for n, j in enumerate(jobs)
                for i, (kind, value) in enumerate(j.request.rows) if kind == "text"}
        scores = score_texts(self.memory.lm, list(docs.values()), self.memory) if docs else {}
        for n, j in enumerate(jobs):
            j.answers = [None] * len(j.request.rows)
            for i, (kind, _) in enumerate(j.request.rows):
                if kind == "text":
                    r = scores[f"{n}/{i}"]
                    if not r["tokens"]:
                        j.error = BadRequest(f"{j.request.named[i]}: a single token; a perplexity needs two")
                    j.answers[i] = {"ppl": r["ppl"], "ppl_lm": r["ppl_lm"], "tokens": r["tokens"]}

    def _continue(self, job: _Job, decoder: Decoder) -> None:
        """The request's prompts join the continuations in flight; each stops at the request's deadline,
        when its caller leaves, or when another of its prompts was refused."""
        def stop() -> str | None:
            if job.error is not None:
                return "request refused"
            if self._stopping:
                return "server stopping"
            if job.cancelled():
                return "caller gone"
            return f"time limit ({self.limits.seconds:g} s)" if self.clock() > job.deadline else None

        for i, (kind, value) in enumerate(job.request.rows):
            if kind == "prompt" and job.error is None:
                try:
                    cfg = replace(job.request.generation, retrieve=True) if i in job.request.retrieve else job.request.generation
                    job.rows.append((i, decoder.add(value, cfg, stop)))
                except ValueError as e:
                    job.error = BadRequest(f"{job.request.named[i]}: {e}")
                except Exception as e:  # noqa: BLE001
                    log.exception("generation failed")
                    job.error = e

    def _busy(self, reason: str) -> Busy:
        """The refusal (503) of a request that never ran, by why it stopped."""
        return Busy({"caller gone": "the caller is gone", "server stopping": "the server is stopping"}.get(
            reason, f"Θ was busy for the request's whole budget ({self.limits.seconds:g} s): try again"))

    def _answer(self, job: _Job) -> None:
        """A request whose continuations all ended: its answers, or its error (a refusal where they all
        stopped before their first token, still waiting for room in the batch)."""
        if job.error is None and job.rows and not any(row.result.tokens for _, row in job.rows):
            job.error = self._busy(job.rows[0][1].result.stopped)
        for i, row in job.rows:
            if row.result.stopped not in ("max_new_tokens", "eos", "request refused"):
                log.warning("a continuation stopped after %d tokens: %s", len(row.result.tokens), row.result.stopped)
            job.answers[i] = row.result.as_dict()
        self._finish(job, job.error)

    def _finish(self, job: _Job, error: Exception | None) -> None:
        if error is None:
            self.failing = None
        elif not isinstance(error, (BadRequest, Busy)):
            self.failing = f"{type(error).__name__}: {error}"
        job.error = error
        job.done.set()
