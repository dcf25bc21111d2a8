"""Θ under concurrent callers: threads on one LM and memory, the serving worker, and the HTTP server
(`monim serve-model`) with its limits, clear refusals, abandoned requests and clean stops. Every
answer given under load is compared with the same request answered alone."""

import datetime as dt
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from monim.learning.policies import make_policy
from monim.storage.index import IndexConfig
from monim.data.stream import DEMO_STREAM, Document, iter_days, open_source
from monim.storage.memory_settings import Settings

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def theta(tiny_model_dir, tmp_path_factory):
    """A calibrated memory of two days (tiny LM), its skip rule on: every reader path has work to do."""
    from monim.learning.recalibration import calibrate
    from monim.lm.model import load_lm
    from monim.learning.memorize import memorize_day
    from monim.theta.memory import Memory

    lm = load_lm(str(tiny_model_dir("llama")))
    root = tmp_path_factory.mktemp("theta")
    memory = Memory(root, lm, Settings(index=IndexConfig(k=16)))
    for day in iter_days(open_source(DEMO_STREAM), dt.date(1987, 3, 2), dt.date(1987, 3, 3)):
        memorize_day(memory, day.capped(3), make_policy("fullmem"))
        calibrate(memory, day.capped(3))
    return Memory.open(root, lm)


def texts(n: int, chars: int = 600) -> list[str]:
    docs = [d for day in iter_days(open_source(DEMO_STREAM), dt.date(1987, 3, 4), dt.date(1987, 3, 5)) for d in day.train]
    return [d.text[:chars] for d in docs[:n]]


def at_once(service, bodies: list[dict]) -> list:
    """The service's answers to the bodies, each sent from its own thread at the same time."""
    together: list = [None] * len(bodies)
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, service.answer(bodies[i])))
               for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return together


def test_threads_on_one_theta_get_what_each_gets_alone(theta):
    """Eight threads score and continue different texts on one LM and one memory at once: each answer
    is the one the same call gives alone (the key is captured per call; no counter is shared)."""
    from monim.evaluation.evaluate import evaluate
    from monim.serving.generate import GenerateConfig, generate

    lm, items = theta.lm, texts(8)
    calls = [(lambda t=t: evaluate(lm, [Document("t", dt.date.min, t)], theta)) if i % 2 else
             (lambda t=t: generate(lm, " ".join(t.split()[:10]), theta, GenerateConfig(max_new_tokens=6)).as_dict())
             for i, t in enumerate(items)]
    alone = [call() for call in calls]
    together: list = [None] * len(calls)
    errors = []

    def run(i: int) -> None:
        try:
            for _ in range(3):  # again and again, so that the calls overlap
                together[i] = calls[i]()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for a, b in zip(alone, together):
        assert a == b


PROMPT_WORDS = (10, 3, 25)  # the reference prompts: the first words of texts(3)
# generate() on `theta` as recorded before prompts were decoded together (each then alone in its own loop):
# (skip threshold, prompt, temperature, tokens, λ, Θ's log P of each token)
BEFORE_BATCHING = [
    (None, 0, 0.0, [3224, 3037, 13, 198, 220, 220, 220, 220],
     [0.25] * 8, [-2.55182, -2.34745, -1.79175, -1.75811, -2.20988, -1.76083, -1.85543, -1.85588]),
    (None, 0, 0.9, [3224, 313, 263, 6848, 36460, 9825, 14707, 10174],
     [0.25] * 8, [-2.55182, -11.05191, -4.10319, -5.01708, -11.09723, -4.16753, -2.11245, -11.07704]),
    (None, 1, 0.0, [262, 198, 220, 220, 220, 220, 220, 220],
     [0.25] * 8, [-2.82041, -3.06089, -2.77118, -1.85972, -1.86073, -1.96557, -2.08235, -2.08327]),
    (None, 1, 0.9, [262, 1306, 1542, 585, 40769, 1315, 12, 13158],
     [0.25] * 8, [-2.82041, -4.16352, -1.91142, -4.51366, -11.09773, -4.18653, -2.37768, -11.07664]),
    (None, 2, 0.0, [2828, 531, 13, 198, 220, 220, 220, 220],
     [0.25] * 8, [-2.71759, -2.0083, -2.546, -1.66865, -2.5482, -1.76075, -1.76087, -1.76099]),
    (None, 2, 0.9, [2828, 6193, 262, 1315, 15587, 12, 16, 34462],
     [0.25] * 8, [-2.71759, -11.05201, -4.56607, -4.14467, -11.09724, -4.18597, -2.5368, -11.07676]),
    (0.3, 0, 0.0, [3224, 3037, 4926, 422, 257, 614, 2961, 35358],
     [0.25, 0.25, 0.0, 0.0, 0.25, 0.25, 0.25, 0.0], [-2.55182, -2.34745, -10.36058, -10.32625, -1.88954, -2.93456, -2.03747, -10.36616]),
    (0.3, 0, 0.9, [3224, 313, 18883, 35402, 13921, 8190, 8829, 26297],
     [0.25, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [-2.55182, -11.05191, -10.90066, -10.81962, -10.80929, -10.74343, -10.71549, -10.7899]),
    (0.3, 1, 0.0, [18389, 23108, 26346, 4745, 31874, 26737, 6357, 26435],
     [0.0] * 8, [-10.30799, -10.37985, -10.35275, -10.36626, -10.36708, -10.32273, -10.30651, -10.36829]),
    (0.3, 1, 0.9, [19381, 22764, 34675, 3109, 15955, 23609, 32877, 28217],
     [0.0] * 8, [-10.83844, -10.7639, -10.9002, -10.81911, -10.80897, -10.74412, -10.71524, -10.7897]),
    (0.3, 2, 0.0, [13625, 32266, 4289, 9618, 33260, 49098, 15992, 75],
     [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.25], [-10.35076, -10.40686, -10.36979, -10.34998, -10.38902, -10.36851, -10.30715, -2.47644]),
    (0.3, 2, 0.9, [45119, 8646, 33010, 290, 21366, 1201, 37977, 15160],
     [0.0, 0.25, 0.0, 0.25, 0.25, 0.0, 0.0, 0.0], [-10.83804, -11.0523, -10.89985, -4.4496, -11.09723, -10.74379, -10.71512, -10.78944]),
]


def test_a_prompt_alone_is_continued_as_before_prompts_were_decoded_together(theta):
    """generate() (one row) writes the recorded tokens, λ and log P (1e-4), greedy and sampled, ± the skip rule; past
    a step float rounding decides (a skip threshold ±1e-3 writes them; a greedy tie within 1e-4) nothing is compared."""
    from monim.serving.generate import GenerateConfig, generate
    from monim.theta.memory import Memory

    prompts = [" ".join(t.split()[:n]) for t, n in zip(texts(3), PROMPT_WORDS)]
    for skip, i, temperature, tokens, lams, logp in BEFORE_BATCHING:
        cfg = GenerateConfig(max_new_tokens=8, temperature=temperature, top_p=0.8, seed=3, keep_distributions=True)
        gens = [generate(theta.lm, prompts[i], Memory.open(theta.ds.root, theta.lm, skip_threshold=t), cfg)
                for t in ([None] if skip is None else [skip, skip - 1e-3, skip + 1e-3])]
        gen = next((g for g in gens if g.tokens == tokens), gens[0])
        n = next((j for j, (a, b) in enumerate(zip(gen.tokens, tokens)) if a != b), len(tokens))
        assert n == len(tokens) or temperature == 0.0 and abs(gen.logprobs[n][tokens[n]] - gen.logprobs[n][gen.tokens[n]]) < 1e-4
        np.testing.assert_allclose(gen.lams[:n + 1], lams[:n + 1], atol=1e-4)
        np.testing.assert_allclose([p[t] for p, t in zip(gen.logprobs[:n + 1], gen.tokens)], logp[:n + 1], atol=1e-4)


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

    prompts = [" ".join(t.split()[:n]) for t, n in zip(texts(4), (12, 4, 20, 8))]
    long = {"dataframe_records": [{"prompt": prompts[0]}], "params": {"max_new_tokens": 200}}
    short = [{"dataframe_records": [{"prompt": prompts[1]}, {"prompt": prompts[2]}], "params": {"max_new_tokens": 6}},
             {"dataframe_records": [{"text": texts(5)[4]}, {"prompt": prompts[2]}],
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

    prompts = [" ".join(t.split()[: 3 + i % 5]) for i, t in enumerate(texts(8) * 8)]
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
    from monim.theta.memory import Memory
    from monim.serving.service import Service

    other = Memory(tmp_path, theta.lm, Settings(calibrated=False, index=IndexConfig(k=16)))  # another Θ: λ 0.7
    memorize_day(other, next(iter_days(open_source(DEMO_STREAM), dt.date(1987, 3, 2))).capped(2), make_policy("fullmem"))
    other.ds.set_theta({"date": "1987-03-02", "lam": 0.7, "temperature": 1.0})
    prompts = [" ".join(t.split()[:n]) for t, n in zip(texts(2), (12, 6))]
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
                  for i, t in enumerate(texts(12))]
        alone = [service.answer(b) for b in bodies]
        together = at_once(service, bodies)
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

    whole = " ".join(texts(60, 4000))
    items = [whole[300 * i : 300 * i + n] for i, n in enumerate((600, 2500, 4500, 7000, 9500, 3500))]
    stride = theta.settings.window.stride
    steps = {-(-len(theta.lm.tokenizer(t)["input_ids"]) // stride) for t in items}
    assert len(steps) >= 4  # the texts span different numbers of windows
    service = Service(theta, Limits(max_rows=4, max_chars=10000, seconds=300))
    try:
        bodies = [{"dataframe_records": [{"text": t}]} for t in items]
        alone = [service.answer(b) for b in bodies]
        together = at_once(service, bodies)
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


def test_every_format_of_mlflows_reads_as_the_same_rows_and_refusals_name_the_formats_field():
    """The four request formats MLflow's scoring server takes, as it reads them into a DataFrame (its own
    reading is the reference), give the same rows; a refusal names the field
    as the body wrote it (a lone surrogate included: the tokenizer would fail on it)."""
    import pandas as pd
    from mlflow.pyfunc.scoring_server import infer_and_parse_data

    from monim.serving.service import BadRequest, Limits, parse

    rows = [{"text": "Oil prices rose."}, {"prompt": "The bank said", "retrieve": True}, {"prompt": "Shares fell"}]
    frame = pd.DataFrame(rows)
    columns = {k: [r.get(k) for r in rows] for k in ("text", "prompt", "retrieve")}
    bodies = [{"dataframe_records": rows}, {"dataframe_split": frame.to_dict(orient="split")},
              {"dataframe_split": json.loads(frame.to_json(orient="split"))}, {"inputs": rows}, {"inputs": columns},
              {"instances": rows}, {"instances": columns}]
    want = [("text", "Oil prices rose."), ("prompt", "The bank said"), ("prompt", "Shares fell")]
    for body in bodies:
        request = parse(json.loads(json.dumps(body)), Limits())
        assert request.rows == want and request.retrieve == {1}, body
        if body.get("instances") is not rows:  # (MLflow reads records of different fields under instances as columns)
            read = pd.DataFrame(infer_and_parse_data(json.loads(json.dumps(body))))  # MLflow's reading
            assert [(k, v) for r in read.to_dict("records") for k, v in r.items() if k != "retrieve" and v == v
                    and v is not None] == want, body
    assert parse({"inputs": {"prompt": "Hi"}}, Limits()).rows == [("prompt", "Hi")]  # a dict of values: one row
    assert parse({"dataframe_split": {"columns": ["text"], "data": ["a b", "c d"]}}, Limits()).rows == [
        ("text", "a b"), ("text", "c d")]  # one column: pandas takes a value a row
    for body, says in (({"dataframe_split": {"columns": ["text"], "data": [["a"], ["b", "c"]]}}, "dataframe_split.data[1]: "),
                       ({"dataframe_split": {"data": [["a"]]}}, "dataframe_split.columns: "),
                       ({"dataframe_split": {"columns": ["text"], "data": [["a"]], "index": [0, 1]}}, "dataframe_split.index: "),
                       ({"dataframe_split": {"columns": ["text"], "data": [["a"]], "orient": "split"}}, "unknown field 'orient'"),
                       ({"dataframe_split": {"columns": ["txt"], "data": [["a"]]}}, "dataframe_split.data[0]: give exactly one"),
                       ({"dataframe_split": {"columns": ["text"], "data": [["a"]] * 33}}, "dataframe_split.data: 33 rows; at most 32"),
                       ({"inputs": {"text": ["a", "b"], "prompt": ["c"]}}, "inputs: give every column as a list"),
                       ({"instances": {"text": ["a", "x" * 20_001]}}, "instances.text[1]: 20001 characters"),
                       ({"inputs": [{"prompt": "ok"}, {"text": "a\ud800b"}]}, "inputs[1].text: a lone surrogate '\\ud800' at character 1"),
                       ({"dataframe_split": {"columns": ["prompt"], "data": [["\udfff"]]}}, "dataframe_split.data[0].prompt: a lone"),
                       ({"instances": {"prompt": ["x"], "retrieve": ["yes"]}}, "instances.retrieve[0]: true or false"),
                       ({"dataframe_records": [{"text": "a", "txt": None}]}, "unknown field 'txt'"),
                       ({"inputs": ["a", "b"]}, "inputs[0]: expected an object"),
                       ({"dataframe_records": [{"text": "a"}], "inputs": {"text": "a"}}, "send exactly one of")):
        with pytest.raises(BadRequest, match=re.escape(says)):
            parse(body, Limits())


ROW_NAMES = st.sampled_from(["text", "prompt", "retrieve"])
TEXT = st.text(st.characters(exclude_categories=()) | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
               | st.sampled_from("\x00 ab"), max_size=8)  # any code point, lone surrogates and NULs often
VALUE = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ROW_NAMES | TEXT, inner, max_size=3),
                     max_leaves=8)
CELL = st.one_of(TEXT, st.none() | VALUE)  # a row's text or prompt: text half the time
ROW = st.one_of(st.dictionaries(st.sampled_from(["text", "prompt"]), CELL, min_size=1, max_size=2),
                st.fixed_dictionaries({"prompt": CELL, "retrieve": st.booleans() | VALUE}),
                st.dictionaries(ROW_NAMES | TEXT, VALUE, max_size=3), VALUE)
COLUMNS = st.dictionaries(ROW_NAMES, st.lists(CELL, min_size=1, max_size=3) | CELL, min_size=1, max_size=3) | \
    st.dictionaries(ROW_NAMES | TEXT, st.lists(VALUE, max_size=3) | VALUE, max_size=3)
PARAMS = st.fixed_dictionaries({}, optional={"max_new_tokens": st.integers(-1, 9) | VALUE, "temperature": st.floats() | VALUE,
                                             "top_p": st.floats() | VALUE, "seed": st.integers(-2, 2**64) | VALUE,
                                             "sources": st.booleans() | st.integers(-1, 4) | VALUE}) | \
    st.dictionaries(TEXT, VALUE, max_size=2) | VALUE
SPLIT = st.fixed_dictionaries({"columns": st.lists(ROW_NAMES, min_size=1, max_size=3) | VALUE,
                               "data": st.lists(st.lists(CELL, min_size=1, max_size=3) | CELL, min_size=1, max_size=3) | VALUE},
                              optional={"index": st.lists(VALUE, max_size=3) | VALUE}) | \
    st.dictionaries(st.sampled_from(["columns", "data", "index"]) | TEXT, VALUE, max_size=3)
BODY = st.one_of(
    st.fixed_dictionaries({"dataframe_records": st.lists(ROW, min_size=1, max_size=4) | VALUE}, optional={"params": PARAMS}),
    st.fixed_dictionaries({"dataframe_split": SPLIT}, optional={"params": PARAMS}),
    *[st.fixed_dictionaries({form: st.lists(ROW, min_size=1, max_size=4) | COLUMNS | VALUE}, optional={"params": PARAMS})
      for form in ("inputs", "instances")],
    st.dictionaries(st.sampled_from(["dataframe_records", "dataframe_split", "inputs", "instances", "params"]) | TEXT,
                    VALUE, max_size=3),
    VALUE)
NAMED = re.compile(r"(dataframe_records|dataframe_split|inputs|instances|params)\b|send |unknown field|the body ")


@settings(max_examples=300, deadline=None)
@given(BODY)
def test_any_json_body_is_a_request_or_a_refusal_naming_its_field(body):
    """Any JSON value in any field, any code point (lone surrogates as JSON writes them, NULs), as sent
    (JSON text) or as a Python value: a Request within the limits, or a BadRequest naming the field."""
    from monim.serving.service import BadRequest, Limits, loads, parse

    limits = Limits(max_rows=3, max_chars=6, max_new_tokens=5)
    for sent in (json.dumps(body).encode(), None):
        try:
            request = parse(body if sent is None else loads(sent, limits), limits)
        except BadRequest as e:
            assert NAMED.match(str(e)) and json.dumps(str(e)), str(e)
            continue
        assert 1 <= len(request.rows) <= 3 and request.generation.max_new_tokens <= 5
        for (name, value), named in zip(request.rows, request.named):
            assert name in ("text", "prompt") and value.strip() and len(value) <= 6 and value.encode("utf-8")
            assert named.startswith(next(iter(set(body) - {"params"}))) and f".{name}" in named


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["dataframe_records", "dataframe_split", "inputs", "instances", "inputs.", "instances."]),
       st.lists(st.tuples(st.sampled_from(["text", "prompt"]), TEXT), min_size=1, max_size=3))
def test_any_text_in_any_format_is_its_row_or_a_refusal_naming_that_row(form, rows):
    """Rows of any text (lone surrogates, NULs, blanks), sent as JSON in each format ("inputs." is a dict of
    columns): the same rows, or a refusal naming the first bad one's field as that format writes it."""
    from monim.serving.service import BadRequest, Limits, loads, parse

    names = ("text", "prompt")
    if form == "dataframe_split":
        body, where = {form: {"columns": list(names), "data": [[v if n == c else None for c in names] for n, v in rows]}}, \
            "dataframe_split.data[{i}].{n}"
    elif form.endswith("."):
        body, where = {form[:-1]: {c: [v if n == c else None for n, v in rows] for c in names}}, form + "{n}[{i}]"
    else:
        body, where = {form: [{n: v} for n, v in rows]}, form + "[{i}].{n}"
    limits = Limits(max_chars=6)
    bad = [(i, n, "non-empty" if not v.strip() else "characters" if len(v) > 6 else "surrogate")
           for i, (n, v) in enumerate(rows) if not v.strip() or len(v) > 6 or any(0xD800 <= ord(c) < 0xE000 for c in v)]
    try:
        request = parse(loads(json.dumps(body).encode(), limits), limits)
    except BadRequest as e:
        assert bad and str(e).startswith(where.format(i=bad[0][0], n=bad[0][1]) + ": ") and bad[0][2] in str(e), (str(e), bad)
        return
    assert not bad and request.rows == rows


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64) | st.builds(lambda n, s: (s * n).encode(errors="surrogatepass"), st.integers(0, 200),
                                          st.sampled_from(["[", "{\"a\":", "[\"]\",", "\"\\ud800\"", "\\"])))
def test_any_body_bytes_are_json_or_a_refusal(raw):
    """Any bytes (deep nesting included: counted before parsing) are JSON or a BadRequest, no other error."""
    from monim.serving.service import BadRequest, Limits, loads

    try:
        loads(raw, Limits())
    except BadRequest as e:
        assert str(e).startswith("the body ")


@pytest.fixture(scope="module")
def served(monim, prefect_api, tiny_model_dir, tmp_path_factory):
    """A work directory learned by `monim learn` (MLflow on), and `monim serve-model` on its champion."""
    import flows.servers.local as servers

    workdir = tmp_path_factory.mktemp("served") / "monim-demo"  # the README's name for it
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_API_URL": prefect_api}
    subprocess.run([monim.script, "learn", "--source", str(DEMO_STREAM), "--start", "1987-03-02", "--end", "1987-03-03",
                    "--policy", "fullmem", "--workdir", str(workdir), "--model", str(tiny_model_dir("llama")),
                    "--max-docs", "3"], env=env, check=True, capture_output=True, timeout=900)
    port, log = servers.free_port(), workdir / "server.log"
    proc = subprocess.Popen([monim.script, "serve-model", "--workdir", str(workdir), "--port", str(port), "--max-new-tokens",
                             "200"], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2)
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
    yield port, proc, log, workdir
    if proc.poll() is None:
        proc.kill()


def test_the_server_answers_clients_at_once_as_alone_and_errors_in_one_line(served, invoke):
    port, proc, log, _ = served
    bodies = [{"dataframe_records": [{"text": t}, {"prompt": " ".join(t.split()[:6])}], "params": {"max_new_tokens": 4}}
              for t in texts(6, 400)]
    alone = [invoke(port, b) for b in bodies]
    assert all(status == 200 for status, _ in alone), alone
    together: list = [None] * len(bodies)
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, invoke(port, bodies[i]))) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (_, a), (status, b) in zip(alone, together):
        assert status == 200
        (sa, ga), (sb, gb) = a["predictions"], b["predictions"]
        assert sb["ppl"] == pytest.approx(sa["ppl"], rel=1e-5) and gb["tokens"] == ga["tokens"]
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())
    assert health["as_of"] in ("1987-03-02", "1987-03-03") and health["limits"]["max_new_tokens"] == 200
    for body, status, says in ((b"{not json", 400, "not JSON"), ({}, 400, "dataframe_records"),
                               ({"dataframe_records": [{"prompt": "x"}], "params": {"max_new_tokens": 500}}, 400, "at most 200"),
                               ({"dataframe_records": [{"text": "x"}], "params": {"max_tokens": 5}}, 400, "'max_tokens'"),
                               ({"dataframe_records": [{"prompt": "x"}], "params": {"sources": True}}, 200, "")):
        got, out = invoke(port, body)
        assert got == status and says in out.get("message", ""), (body, got, out)
        assert "Traceback" not in json.dumps(out) and "DataFrame" not in json.dumps(out)


def same_answers(got: list[dict], want: list[dict]) -> bool:
    """The same rows answered alike: a text's PPL within 1e-5 (scored beside others), a continuation's tokens."""
    return len(got) == len(want) and all(
        g["tokens"] == w["tokens"] and (g["ppl"] == pytest.approx(w["ppl"], rel=1e-5) if "ppl" in w else g["text"] == w["text"])
        for g, w in zip(got, want))


def test_the_server_takes_mlflows_four_formats_and_its_scoring_client(served, invoke):
    """MLflow's own scoring client (a DataFrame sent as dataframe_split) and each of MLflow's formats by
    hand get the answers the same rows get as dataframe_records."""
    import pandas as pd
    from mlflow.pyfunc.scoring_server.client import ScoringServerClient

    port = served[0]
    rows = [{"text": t} for t in texts(2, 300)] + [{"prompt": "The bank said"}]
    params = {"max_new_tokens": 4}
    status, want = invoke(port, {"dataframe_records": rows, "params": params})
    assert status == 200, want
    frame = pd.DataFrame(rows)
    assert same_answers(ScoringServerClient("127.0.0.1", port).invoke(frame, params)["predictions"], want["predictions"])
    columns = {k: [r.get(k) for r in rows] for k in ("text", "prompt")}
    for body in ({"dataframe_split": frame.to_dict(orient="split")}, {"inputs": rows}, {"inputs": columns},
                 {"instances": rows}, {"instances": columns}):
        status, out = invoke(port, body | {"params": params})
        assert status == 200 and same_answers(out["predictions"], want["predictions"]), (body, out)


def test_the_mlflow_model_takes_what_a_dataframe_takes(served, invoke):
    """The registered pyfunc model, as MLflow loads it, answers a DataFrame, records, a dict of columns and a
    dict of one value each as the server answers the same rows."""
    import mlflow
    import pandas as pd
    from mlflow.tracking import MlflowClient

    port, _, _, workdir = served
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (name,) = [m.name for m in client.search_registered_models()]
    model = mlflow.pyfunc.load_model(client.get_model_version_download_uri(name, client.get_model_version_by_alias(
        name, "champion").version))
    items = texts(2, 300)
    status, want = invoke(port, {"dataframe_records": [{"text": t} for t in items]})
    assert status == 200, want
    for given in (pd.DataFrame({"text": items}), [{"text": t} for t in items], {"text": items}):
        assert same_answers(model.predict(given), want["predictions"]), given
    assert same_answers(model.predict({"text": items[0]}), want["predictions"][:1])


def test_the_server_bounds_what_it_reads_and_every_error_is_its_json_object(served, invoke):
    """A body over the size limit is refused (413) as declared and, chunked, once read that far; one nested
    too deep, or holding a lone surrogate, gets a 400 naming it; a route or method not served a 404/405:
    each the documented JSON object. The server then answers as before, and says it is ok."""
    import http.client

    port = served[0]
    body = {"dataframe_records": [{"text": texts(1, 300)[0]}]}
    status, before = invoke(port, body)
    limits = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())["limits"]
    assert status == 200 and limits["max_body_bytes"] == 12 * 20_000 * 32 + 65_536 and limits["max_depth"] == 32

    def send(method: str, path: str, headers: dict, chunks=()) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.putrequest(method, path)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        try:
            for chunk in chunks:
                conn.send(chunk)
        except OSError:  # the server answered and closed before the whole body was sent
            pass
        answer = conn.getresponse()
        out = json.loads(answer.read())
        conn.close()
        assert set(out) == {"error_code", "message"}, out
        return answer.status, out

    mib = b" " * (1 << 20)
    status, out = send("POST", "/invocations", {"Content-Length": str(limits["max_body_bytes"] + 1)}, [b"{"])
    assert status == 413 and out["error_code"] == "REQUEST_ENTITY_TOO_LARGE" and str(limits["max_body_bytes"]) in out["message"]
    chunked = [b"%x\r\n%s\r\n" % (len(mib), mib)] * (limits["max_body_bytes"] // len(mib) + 2) + [b"0\r\n\r\n"]
    status, out = send("POST", "/invocations", {"Transfer-Encoding": "chunked"}, chunked)
    assert status == 413 and "max_body_bytes" in out["message"]
    for deep in (b"[" * 200_000, b'{"a":' * 50_000):
        status, out = send("POST", "/invocations", {"Content-Length": str(len(deep))}, [deep])
        assert status == 400 and out["error_code"] == "BAD_REQUEST" and "nests" in out["message"] and "at most 32" in out["message"]
    surrogate = b'{"dataframe_records": [{"text": "Oil prices \\ud800 rose"}]}'
    status, out = send("POST", "/invocations", {"Content-Length": str(len(surrogate))}, [surrogate])
    assert status == 400 and out["message"].startswith("dataframe_records[0].text: a lone surrogate")
    assert send("GET", "/nowhere", {})[0] == 404 and send("GET", "/invocations", {})[0] == 405
    status, after = invoke(port, body)
    assert status == 200 and after == before
    assert json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())["status"] == "ok"


def test_an_abandoned_request_stops_and_a_sigterm_stops_the_server(served, invoke):
    import psutil

    port, proc, log, _ = served
    long = {"dataframe_records": [{"prompt": p} for p in ("The bank", "Oil prices", "The company")],
            "params": {"max_new_tokens": 200}}
    busy = threading.Thread(target=invoke, args=(port, long))  # Θ's worker is busy for a while
    busy.start()
    time.sleep(0.2)
    with pytest.raises(OSError):  # this client gives up waiting: its continuation stops at its next token
        invoke(port, {"dataframe_records": [{"prompt": "The bank said"}], "params": {"max_new_tokens": 200}}, timeout=0.3)
    busy.join()
    deadline = time.monotonic() + 30
    while not re.search(r"stopped after \d+ tokens: caller gone|dropped before it ran", log.read_text()):
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.2)
    children = psutil.Process(proc.pid).children(recursive=True)
    flying = threading.Thread(target=lambda: invoke(port, long, timeout=60))
    flying.start()
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)  # stops within 10 s, a request in flight
    flying.join()
    assert not [p for p in children if p.is_running()]


def test_the_readmes_serving_block_works_pasted_as_written(served, invoke):
    """The README's commands, run by bash as written, beside the work directory (named as the README names it)."""
    port, proc, log, workdir = served
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- serving-example -->\s*```bash\n(.*?)```", readme, re.S).group(1)
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(["bash", "-ec", block], cwd=workdir.parent, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    predictions = json.loads(out.stdout.strip().splitlines()[-1])["predictions"]
    assert predictions[0]["text"] and predictions[1]["ppl"] > 1
