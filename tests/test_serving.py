"""Θ under concurrent callers: threads on one LM and memory, and the serving worker (the HTTP server,
`monim serve-model`, is tests/test_http.py's). Every answer given under load is compared with the
same request answered alone."""

import datetime as dt
import itertools
import re
import threading
import time
from typing import Callable

import numpy as np
import pytest

from helpers import at_once, demo_texts
from monim.core.config import DEMO_STREAM
from monim.data.feed import Document, open_feed
from monim.data.stream import iter_days
from monim.learning.policies import make_policy
from monim.storage.index import IndexConfig
from monim.storage.memory_settings import Settings


def test_threads_on_one_theta_get_what_each_gets_alone(theta):
    """Eight threads score and continue different texts on one LM and one memory at once: each answer
    is the one the same call gives alone (the key is captured per call; no counter is shared)."""
    from monim.evaluation.evaluate import evaluate
    from monim.serving.generate import generate
    from monim.serving.generation import GenerateConfig

    lm, items = theta.lm, demo_texts(8)
    calls = [(lambda t=t: evaluate(lm, [Document("t", dt.date.min, t)], theta)) if i % 2 else
             (lambda t=t: generate(lm, " ".join(t.split()[:10]), theta, GenerateConfig(max_new_tokens=6)).as_dict())
             for i, t in enumerate(items)]
    alone = [call() for call in calls]
    together = at_once(lambda call: [call() for _ in range(3)][-1], calls)  # again and again: the calls overlap
    for a, b in zip(alone, together):
        assert a == b


PROMPT_WORDS = (10, 3, 25)  # the prompts: the first words of demo_texts(3)


@pytest.mark.parametrize("skip", [None, 0.4])  # 0.4: away from the calibrator's λ of most tokens here (0.26-0.30)
def test_a_prompt_decoded_together_with_others_is_continued_as_alone(theta, skip):
    """Prompts continued greedy and sampled by one Decoder, some joining while others are written, each
    write the tokens, λ and Θ's log-probabilities the same prompt written alone (`generate`) does, ± the skip rule."""
    from monim.serving.generate import Decoder, generate
    from monim.serving.generation import GenerateConfig
    from monim.theta.memory import Memory

    memory = Memory.open(theta.ds.root, theta.lm, skip_threshold=skip)
    prompts = [" ".join(t.split()[:n]) for t, n in zip(demo_texts(3), PROMPT_WORDS)]
    asked = [(p, GenerateConfig(max_new_tokens=8, temperature=t, top_p=0.8, seed=3, keep_distributions=True))
             for p in prompts for t in (0.0, 0.9)]
    alone = [generate(memory.lm, p, memory, cfg) for p, cfg in asked]
    decoder = Decoder(memory.lm, memory)
    rows = [decoder.add(p, cfg) for p, cfg in asked[:3]]
    for _ in range(3):
        decoder.advance()
    rows += [decoder.add(p, cfg) for p, cfg in asked[3:]]
    while decoder:
        decoder.advance()
    for a, b in zip(alone, (r.result for r in rows)):
        assert b.tokens == a.tokens and len(a.tokens) == 8
        np.testing.assert_allclose(b.lams, a.lams, atol=1e-5)
        np.testing.assert_allclose(np.stack(b.logprobs), np.stack(a.logprobs), atol=1e-4)
    assert any(0.0 in a.lams for a in alone) == (skip is not None)  # the skip rule left some tokens to the LM alone


@pytest.mark.parametrize("skip", [None, 0.4])
def test_greedy_writes_thetas_top_token_as_scoring_the_prompt_and_its_continuation_gives_it(theta, skip):
    """Each token a greedy continuation writes is Θ's top-1 after its prefix, with Θ's log P and λ, as
    scoring the prompt and continuation as one text gives them: one forward pass without a KV cache,
    Θ's maximum found among its candidates (the LM's top-1 and the neighbours' values), ± the skip rule."""
    import functools

    from monim.lm.scoring import score_tokens
    from monim.lm.token_scores import TokenScores
    from monim.serving.generate import generate
    from monim.serving.generation import GenerateConfig
    from monim.theta.memory import Memory

    memory = Memory.open(theta.ds.root, theta.lm, skip_threshold=skip)
    for prompt in (" ".join(t.split()[:n]) for t, n in zip(demo_texts(3), PROMPT_WORDS)):
        gen = generate(memory.lm, prompt, memory, GenerateConfig(max_new_tokens=8, keep_distributions=True))
        ids = memory.lm.tokenizer(prompt)["input_ids"]
        batch = TokenScores.concat(list(score_tokens(memory.lm, [("g", ids + gen.tokens, 1)], memory.settings.window,
                                                     functools.partial(memory.search, skip=True))))
        assert batch.position.tolist() == list(range(1, len(ids) + 8))
        written, scored = slice(len(ids) - 1, None), memory.theta_scores(batch)  # the rows of the written tokens
        assert batch.target[written].tolist() == gen.tokens == scored.argmax[written].tolist()
        np.testing.assert_allclose(scored.logp[written], [p[t] for p, t in zip(gen.logprobs, gen.tokens)], atol=1e-4)
        lam = np.broadcast_to(memory.lam(batch), len(batch)) * (batch.knn_values[:, 0] >= 0)  # none searched: 0
        np.testing.assert_allclose(gen.lams, lam[written], atol=1e-5)


def same_continuation(a: dict, b: dict) -> bool:
    """The same tokens, and λ per token within 1e-4."""
    return a["tokens"] == b["tokens"] and np.allclose(a["lams"], b["lams"], atol=1e-4, rtol=0)


def send_while(service, first: dict, later: list[tuple[dict, Callable[[], bool]]], after: int,
               between: Callable[[], None] = lambda: None) -> list[tuple[list, float]]:
    """`first` sent, then (once it wrote `after` tokens, and `between` ran) the `later` bodies, each from
    its own thread with its `cancelled`: every (answer or refusal, when it came), in that order."""
    looks: list = []  # the worker looks whether `first`'s caller is there once, then before each token
    out: list = [None] * (1 + len(later))

    def send(i: int, body: dict, cancelled: Callable[[], bool]) -> None:
        try:
            out[i] = (service.answer(body, cancelled), time.monotonic())
        except Exception as e:  # noqa: BLE001 (a refusal is an answer too)
            out[i] = (e, time.monotonic())

    threads = [threading.Thread(target=send, args=(0, first, lambda: bool(looks.append(1))))]
    threads[0].start()
    deadline = time.monotonic() + 60
    while len(looks) <= after + 1:
        assert time.monotonic() < deadline, "the first request did not start"
        time.sleep(0.002)
    between()
    threads += [threading.Thread(target=send, args=(i + 1, body, cancelled)) for i, (body, cancelled) in enumerate(later)]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join()
    return out


def test_requests_join_and_leave_the_continuations_in_flight(theta):
    """Requests sent while a long continuation is written join it (one LM forward a step for all rows):
    the short ones are answered before it ends, a text among them is scored meanwhile, a caller who
    leaves has its continuation stopped at its next token, and every other answer equals the same
    request's alone."""
    from monim.serving.service import Limits, Service

    prompts = [" ".join(t.split()[:n]) for t, n in zip(demo_texts(4), (12, 4, 20, 8))]
    long = {"dataframe_records": [{"prompt": prompts[0]}], "params": {"max_new_tokens": 200}}
    short = [{"dataframe_records": [{"prompt": prompts[1]}, {"prompt": prompts[2]}], "params": {"max_new_tokens": 6}},
             {"dataframe_records": [{"text": demo_texts(5)[4]}, {"prompt": prompts[2]}],
              "params": {"max_new_tokens": 9, "temperature": 0.8, "seed": 5}}]
    leaving = {"dataframe_records": [{"prompt": prompts[3]}], "params": {"max_new_tokens": 200}}
    service = Service(theta, Limits(max_new_tokens=200, seconds=300))
    try:
        alone = [service.answer(b) for b in (long, *short, leaving)]
        assert len(alone[0][0]["tokens"]) == 200
        looks = itertools.count()  # its caller leaves after its fourth token
        later = [(b, lambda: False) for b in short] + [(leaving, lambda: next(looks) >= 5)]
        got = send_while(service, long, later, after=10)
    finally:
        service.close()
    assert same_continuation(got[0][0][0], alone[0][0])
    for (out, when), want in zip(got[1:3], alone[1:3]):
        assert when < got[0][1]  # answered while the long one was still being written
        for a, b in zip(out, want):
            assert same_continuation(a, b) if "lams" in b else a["ppl"] == pytest.approx(b["ppl"], rel=1e-5)
    cut = got[3][0][0]
    assert cut["stopped"] == "caller gone" and cut["tokens"] == alone[3][0]["tokens"][:4] and got[3][1] < got[0][1]


def test_a_request_that_waits_for_room_in_a_full_batch_is_refused_if_its_caller_leaves(theta):
    """64 prompts fill the batch; a request sent meanwhile waits for room, and when its caller leaves
    before it wrote anything it is refused like a request that never ran; the 64 are answered in full."""
    from monim.serving.service import Busy, Limits, Service

    prompts = [" ".join(t.split()[: 3 + i % 5]) for i, t in enumerate(demo_texts(8) * 8)]
    full = {"dataframe_records": [{"prompt": p} for p in prompts], "params": {"max_new_tokens": 40}}
    service = Service(theta, Limits(max_rows=64, seconds=300))
    looks = itertools.count()
    try:
        got = send_while(service, full, [({"dataframe_records": [{"prompt": "The bank"}]}, lambda: next(looks) >= 3)],
                         after=2)
    finally:
        service.close()
    assert [len(a["tokens"]) for a in got[0][0]] == [40] * 64
    assert isinstance(got[1][0], Busy) and "caller is gone" in str(got[1][0]) and got[1][1] < got[0][1]


def test_a_new_theta_answers_at_once_while_the_continuations_in_flight_end_on_the_old(theta, tmp_path):
    """A swap while a continuation is written: it is finished by the Θ it started with, and a request
    sent after the swap is answered by the new Θ without waiting for it: each answer is one Θ's, as
    that Θ answers it alone."""
    from monim.learning.memorize import memorize_day
    from monim.serving.service import Service
    from monim.theta.memory import Memory

    other = Memory(tmp_path, theta.lm, Settings(calibrated=False, index=IndexConfig(k=16)))  # another Θ: λ 0.7
    memorize_day(other, next(iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 2))).capped(2), make_policy("fullmem"))
    other.ds.commits.set_theta({"date": "1987-03-02", "lam": 0.7, "temperature": 1.0})
    prompts = [" ".join(t.split()[:n]) for t, n in zip(demo_texts(2), (12, 6))]
    first = {"dataframe_records": [{"prompt": prompts[0]}], "params": {"max_new_tokens": 120}}
    then = {"dataframe_records": [{"prompt": prompts[1]}], "params": {"max_new_tokens": 8}}
    alone = {}
    for memory in (theta, other):
        service = Service(memory)
        alone[memory] = [service.answer(body)[0] for body in (first, then)]
        service.close()
    assert not any(same_continuation(a, b) for a, b in zip(alone[theta], alone[other]))  # the two Θ differ
    service = Service(theta, about={"version": "1"})
    try:
        got = send_while(service, first, [(then, lambda: False)], after=10,
                         between=lambda: service.swap(other, {"version": "2"}))
    finally:
        service.close()
    assert same_continuation(got[0][0][0], alone[theta][0]) and same_continuation(got[1][0][0], alone[other][1])
    assert got[1][1] < got[0][1] and service.about["version"] == "2"  # answered while the first was still written


def test_the_service_answers_concurrent_requests_as_alone_and_refuses_by_name(theta):
    """Requests from many threads go through one worker (texts scored together in one LM pass):
    each answer equals the same request's alone; bad requests are refused naming the field and limit."""
    from monim.serving.service import BadRequest, Limits, Service

    service = Service(theta, Limits(max_rows=4, max_chars=2000, max_new_tokens=16, seconds=120))
    try:
        bodies = [{"dataframe_records": [{"text": t}]} if i % 3 else
                  {"dataframe_records": [{"prompt": " ".join(t.split()[:8])}], "params": {"max_new_tokens": 5}}
                  for i, t in enumerate(demo_texts(12))]
        alone = [service.answer(b) for b in bodies]
        together = at_once(service.answer, bodies)
        for a, b in zip(alone, together):
            if "ppl" in a[0]:  # scored beside other texts in packed rows: the same to float precision
                assert b[0]["tokens"] == a[0]["tokens"] and b[0]["ppl"] == pytest.approx(a[0]["ppl"], rel=1e-5)
            else:
                assert b[0]["tokens"] == a[0]["tokens"] and b[0]["text"] == a[0]["text"]
        assert service.answer({"dataframe_records": [{"prompt": "The bank"}], "params": {"sources": False}})[0][
            "sentences"][0]["sources"] == []
        for body, says in (({}, "send exactly one of"),
                           ({"dataframe_records": [{"txt": "x"}]}, "unknown field 'txt'"),
                           ({"dataframe_records": [{"text": "x"}], "params": {"max_tokens": 5}}, "params: unknown 'max_tokens'"),
                           ({"dataframe_records": [{"prompt": "x"}], "params": {"max_new_tokens": 17}}, "at most 16"),
                           ({"dataframe_records": [{"text": "x" * 2001}]}, "2001 characters; at most 2000"),
                           ({"dataframe_records": [{"text": "a"}] * 5}, "5 rows; at most 4"),
                           ({"dataframe_records": [{"text": "x"}], "params": {"seed": 1.5}}, "params.seed: expected a whole"),
                           ({"dataframe_records": [{"text": "x"}], "input": []}, "unknown field 'input'"),
                           ({"dataframe_records": [{"text": "x"}], "inputs": []}, "send exactly one of")):
            with pytest.raises(BadRequest, match=re.escape(says)):
                service.answer(body)
    finally:
        service.close()


def test_long_texts_scored_together_get_what_each_gets_alone(theta):
    """Texts of one to many windows, sent at once from many threads, share carried lockstep batches
    (each leaving the batch when it ends): each answer equals the same request's alone."""
    from monim.serving.service import Limits, Service

    whole = " ".join(demo_texts(60, 4000))
    items = [whole[300 * i : 300 * i + n] for i, n in enumerate((600, 2500, 4500, 7000, 9500, 3500))]
    stride = theta.settings.window.stride
    steps = {-(-len(theta.lm.tokenizer(t)["input_ids"]) // stride) for t in items}
    assert len(steps) >= 4  # the texts span different numbers of windows
    service = Service(theta, Limits(max_rows=4, max_chars=10000, seconds=300))
    try:
        bodies = [{"dataframe_records": [{"text": t}]} for t in items]
        alone = [service.answer(b) for b in bodies]
        together = at_once(service.answer, bodies)
        for a, b in zip(alone, together):
            assert b[0]["tokens"] == a[0]["tokens"] and b[0]["ppl"] == pytest.approx(a[0]["ppl"], rel=1e-5)
    finally:
        service.close()


def test_a_continuation_stops_at_its_time_budget_and_when_its_caller_leaves(theta):
    """A clock that moves one second each time it is read: the budget of 10 s ends the continuation
    after a few tokens; a caller that leaves after the fifth look ends it too."""
    import itertools

    from monim.serving.service import Limits, Service

    ticks = itertools.count()
    service = Service(theta, Limits(max_new_tokens=200, seconds=10), clock=lambda: float(next(ticks)))
    try:
        body = {"dataframe_records": [{"prompt": "The market"}], "params": {"max_new_tokens": 200}}
        out = service.answer(body)[0]
        assert out["stopped"] == "time limit (10 s)" and 0 < len(out["tokens"]) < 12
        service.limits = Limits(max_new_tokens=200, seconds=1e9)
        looks = itertools.count()
        out = service.answer(body, lambda: next(looks) >= 5)[0]
        assert out["stopped"] == "caller gone" and len(out["tokens"]) == 4  # looked at before the run, then each token
    finally:
        service.close()
