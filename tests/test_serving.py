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

from monim.core.config import DEMO_STREAM
from monim.data.feed import Document, open_feed
from monim.data.stream import iter_days
from monim.learning.policies import make_policy
from monim.storage.index import IndexConfig
from monim.storage.memory_settings import Settings


@pytest.fixture(scope="module")
def theta(tiny_model_dir, tmp_path_factory):
    """A calibrated memory of two days (tiny LM), its skip rule on: every reader path has work to do."""
    from monim.learning.calibration import calibrate
    from monim.learning.memorize import memorize_day
    from monim.lm.model import load_lm
    from monim.theta.memory import Memory

    lm = load_lm(str(tiny_model_dir("llama")))
    root = tmp_path_factory.mktemp("theta")
    memory = Memory(root, lm, Settings(index=IndexConfig(k=16)))
    for day in iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 2), dt.date(1987, 3, 3)):
        memorize_day(memory, day.capped(3), make_policy("fullmem"))
        calibrate(memory, day.capped(3))
    return Memory.open(root, lm)


def texts(n: int, chars: int = 600) -> list[str]:
    docs = [d for day in iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 4), dt.date(1987, 3, 5)) for d in day.train]
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
    from monim.serving.generate import generate
    from monim.serving.generation import GenerateConfig

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
    from monim.serving.generate import generate
    from monim.serving.generation import GenerateConfig
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
    from monim.serving.service import Service
    from monim.theta.memory import Memory

    other = Memory(tmp_path, theta.lm, Settings(calibrated=False, index=IndexConfig(k=16)))  # another Θ: λ 0.7
    memorize_day(other, next(iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 2))).capped(2), make_policy("fullmem"))
    other.ds.commits.set_theta({"date": "1987-03-02", "lam": 0.7, "temperature": 1.0})
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
