"""Multiple-choice QA: the Wilson interval by hand, bad input, choices scored against a direct
forward pass, a memory that holds the answers, and the real RealTime QA quiz file."""

import datetime as dt
import json

import numpy as np
import pytest
import torch

from monim.data.feed import Document, StreamError
from monim.evaluation.qa import Question, answer_questions, prompt, read_questions, shots_for, wilson
from monim.lm.scoring import score
from monim.storage.entries import Entries
from monim.storage.index import IndexConfig
from monim.storage.memory_settings import Settings
from monim.theta.memory import Memory


def q(i: int, day: int, answer: int = 0) -> Question:
    return Question(f"q{i}", dt.date(2022, 6, day), f"Which city hosts summit number {i}?",
                    ("Paris", "Tokyo", "Nairobi", "Lima"), (answer,))


QUESTIONS = [q(i, 1 + i % 3, i % 4) for i in range(8)]


def test_wilson_interval_by_hand():
    low, high = wilson(8, 10)  # standard table value: 0.490 to 0.943
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == pytest.approx(1.0)


def test_bad_questions_name_file_line_and_field(tmp_path):
    good = {"question": "Who?", "choices": ["a", "b"], "answer": [1], "date": "2022-06-03"}
    cases = [({**good, "answer": [2]}, "field 'answer'"), ({**good, "choices": ["a", " "], "answer": [0]}, "field 'choices'"),
             ({**good, "choices": ["a", "", "b"]}, "field 'answer': \\[1\\] points to an empty choice"),
             ({k: v for k, v in good.items() if k != "date"}, "field 'date': missing"),
             ({**good, "date": "June"}, "field 'date'"), ({**good, "question": ""}, "field 'question'")]
    for row, message in cases:
        path = tmp_path / "q.jsonl"
        path.write_text(json.dumps(good) + "\n\n" + json.dumps(row) + "\n")
        with pytest.raises(StreamError, match=f"q.jsonl:3: {message}"):
            read_questions(path)
    path.write_text(json.dumps(good) + "\n{oops\n")
    with pytest.raises(StreamError, match="q.jsonl:2: not valid JSON"):
        read_questions(path)
    path.write_text("\n".join(json.dumps({**good, "date": f"2022-06-0{d}"}) for d in (1, 3, 5)))
    assert [x.date.day for x in read_questions(path, dt.date(2022, 6, 2), dt.date(2022, 6, 5))] == [3, 5]
    path.write_text(json.dumps({**good, "choices": ["a", "", "b"], "answer": [2]}))  # an empty choice is dropped
    assert read_questions(path)[0].choices == ("a", "b") and read_questions(path)[0].answer == (1,)


def test_shots_come_from_other_quizzes():
    shots = shots_for(QUESTIONS[0], QUESTIONS, 2)
    assert [s.id for s in shots] == ["q1", "q2"] and all(s.date != QUESTIONS[0].date for s in shots)
    text = prompt(QUESTIONS[0], shots)
    assert text.count("Question:") == 3 and text.endswith("summit number 0?\nAnswer:")
    assert "Answer: Tokyo\n\n" in text  # q1's right answer


def reference_choice(lm, context: str, choices) -> int:
    """The choice with the highest mean log-probability per answer token, from one forward pass each."""
    ctx = lm.tokenizer(context)["input_ids"]
    means = []
    for choice in choices:
        ans = lm.tokenizer(" " + choice, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([ctx + ans])
        with torch.no_grad():
            logp = torch.log_softmax(lm.model(ids).logits[0].double(), -1)
        means.append(np.mean([logp[len(ctx) + j - 1, t].item() for j, t in enumerate(ans)]))
    return int(np.argmax(means))


@pytest.mark.parametrize("shots", [0, 1])
def test_bare_lm_answers_equal_a_direct_forward_pass(tiny, shots):
    got = answer_questions(tiny, QUESTIONS, {"lm": None}, shots)["lm"]
    picks = [reference_choice(tiny, prompt(x, shots_for(x, QUESTIONS, shots)), x.choices) for x in QUESTIONS]
    hits = sum(p in x.answer for p, x in zip(picks, QUESTIONS))
    assert got["qa_n"] == len(QUESTIONS) and got["qa_accuracy"] == hits / len(QUESTIONS)
    assert (got["qa_ci_low"], got["qa_ci_high"]) == pytest.approx(wilson(hits, len(QUESTIONS)))


def test_a_memory_holding_the_answers_answers_them(tiny, tmp_path):
    # memorize every token of each question's prompt followed by its right answer
    docs = [Document(x.id, x.date, prompt(x, []) + " " + x.choices[x.answer[0]]) for x in QUESTIONS]
    memory = Memory(tmp_path, tiny, Settings(index=IndexConfig(k=8)))
    parts = [Entries(b.key, b.target, list(b.doc_id), b.position) for b in score(tiny, docs)]
    memory.ds.commits.commit_day("2022-06-01", Entries.concat(parts, tiny.hidden_size), sum(len(p) for p in parts), "fullmem")
    memory.ds.commits.set_theta({"lam": 0.9, "temperature": 0.01, "date": "2022-06-01"})  # exact matches dominate
    out = answer_questions(tiny, QUESTIONS, {"memory": memory, "lm": None})
    assert out["memory"]["qa_accuracy"] == 1.0 > out["lm"]["qa_accuracy"]


@pytest.mark.slow
def test_the_realtime_qa_quiz_reads_whole(data_dir):
    questions = read_questions(data_dir / "qa" / "realtimeqa-quiz-2022-06-to-09.jsonl")
    assert len(questions) == 459
    assert min(x.date for x in questions) >= dt.date(2022, 6, 1) and max(x.date for x in questions) <= dt.date(2022, 10, 7)
    assert all(len(x.choices) >= 2 and all(0 <= a < len(x.choices) for a in x.answer) for x in questions)
