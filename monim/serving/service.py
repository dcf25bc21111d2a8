"""Serving Θ to many callers: requests checked against documented limits (each refusal names the
field and the limit), one worker thread that alone runs Θ (concurrent texts are scored together in
one LM pass, concurrent prompts decoded together, a token of each a step), and work bounded in time:
a request that waits or runs past its budget, or whose caller is gone, stops and says so. Another Θ,
loaded whole elsewhere, is swapped in by the worker between requests: every request is answered by one Θ.

A request is MLflow's scoring format in any of its four forms (monim.serving.request). A `text` row
gets Θ's perplexity (and the LM's alone), a `prompt` row a continuation with λ per token and sources.
"""

from __future__ import annotations

import datetime as dt
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from monim.data.feed import Document
from monim.evaluation.evaluate import score_texts
from monim.serving.generate import Decoder, Row
from monim.serving.request import BadRequest, Limits, Request, parse
from monim.theta.memory import Memory

log = logging.getLogger(__name__)
class Busy(RuntimeError):
    """The request waited past its time budget before Θ was free (answered 503: try again)."""



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

    LOOK_S = 1.0  # the served files are looked at again at most this often (Memory.damaged: a stat each)

    def __init__(self, memory: Memory, limits: Limits | None = None, clock: Callable[[], float] = time.monotonic,
                 about: dict | None = None):
        self.memory, self.limits, self.clock = memory, limits or Limits(), clock
        self.about = dict(about or {}) | {"served_since": now()}
        self.failing: str | None = None  # the last request's failure, until one is answered again
        self.damaged: str | None = None  # why the served files differ from their commit: nothing is answered
        self._looked = -float("inf")
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
        self.damaged, self._looked = None, -float("inf")  # verified whole as it was loaded
        log.warning("now serving %s", ", ".join(f"{k} {v}" for k, v in nxt[1].items()))
        return True

    def look(self) -> str | None:
        """Why the served Θ's files differ from their commit, looked at again (at most every LOOK_S)."""
        if self.clock() - self._looked >= self.LOOK_S:
            self._looked, self.damaged = self.clock(), self.memory.damaged()
        return self.damaged

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
        decoders, closing = [Decoder(self.memory.lm, self.memory)], False
        running: list[tuple[_Job, Decoder]] = []  # (job, its decoder)
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
            elif self.look():  # no answer from files that differ from their commit, nor the rest of one
                for j in jobs + [j for j, _ in running]:
                    j.error = Busy(self.damaged)
                    if j in jobs:
                        self._finish(j, j.error)
            else:
                running += [(j, decoders[-1]) for j in self._start(jobs, decoders[-1])]
            for j, _ in [(j, d) for j, d in running if all(r.result for _, r in j.rows)]:
                self._answer(j)
            running = [(j, d) for j, d in running if not j.done.is_set()]
            decoders = [d for d in decoders[:-1] if len(d)] + decoders[-1:]  # an old Θ's decoder, once drained, goes
            for n, decoder in enumerate(decoders):
                try:
                    decoder.advance()
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
        ended = [(i, row.result) for i, row in job.rows if row.result is not None]  # all of them, by now
        if job.error is None and ended and not any(result.tokens for _, result in ended):
            job.error = self._busy(ended[0][1].stopped)
        for i, result in ended:
            if result.stopped not in ("max_new_tokens", "eos", "request refused"):
                log.warning("a continuation stopped after %d tokens: %s", len(result.tokens), result.stopped)
            job.answers[i] = result.as_dict()
        self._finish(job, job.error)

    def _finish(self, job: _Job, error: Exception | None) -> None:
        if error is None:
            self.failing = None
        elif not isinstance(error, (BadRequest, Busy)):
            self.failing = f"{type(error).__name__}: {error}"
        job.error = error
        job.done.set()
