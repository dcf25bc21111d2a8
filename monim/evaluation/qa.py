"""Multiple-choice QA (RealTime QA's news quizzes): each choice scored by the length-normalized
log-likelihood of the answer given the question (and k solved examples), under LM + memory."""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from monim.core.config import ScoreConfig
from monim.data.feed import StreamError, parse_date
from monim.evaluation.evaluate import searched, theta_of
from monim.lm.model import LM
from monim.lm.scoring import score_tokens
from monim.lm.token_scores import TokenScores
from monim.theta.ralm import Prefixes, articles_of, in_context, reach


@dataclass(frozen=True)
class Question:
    """One multiple-choice question; `answer` holds the indices of the right choices."""

    id: str
    date: dt.date
    question: str
    choices: tuple[str, ...]
    answer: tuple[int, ...]


def _question(row: object, where: str) -> Question:
    """A question from one JSON line, or StreamError naming file, line and field."""
    if not isinstance(row, dict):
        raise StreamError(f"{where}: not a JSON object")
    for name in ("question", "choices", "answer", "date"):
        if name not in row:
            raise StreamError(f"{where}: field '{name}': missing")
    if not isinstance(row["question"], str) or not row["question"].strip():
        raise StreamError(f"{where}: field 'question': expected non-empty text")
    choices, answer = row["choices"], row["answer"]
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise StreamError(f"{where}: field 'choices': expected a list of texts")
    if (not isinstance(answer, list) or not answer
            or not all(isinstance(a, int) and not isinstance(a, bool) and 0 <= a < len(choices) for a in answer)):
        raise StreamError(f"{where}: field 'answer': expected indices into the {len(choices)} choices, got {answer!r}")
    kept = [i for i, c in enumerate(choices) if c.strip()]  # empty choices (a scraping artefact) are dropped
    if any(a not in kept for a in answer):
        raise StreamError(f"{where}: field 'answer': {answer!r} points to an empty choice")
    if len(kept) < 2:
        raise StreamError(f"{where}: field 'choices': expected at least 2 non-empty choices")
    try:
        date = parse_date(row["date"])
    except (TypeError, ValueError) as e:
        raise StreamError(f"{where}: field 'date': {e}") from None
    return Question(str(row.get("id", where)), date, row["question"].strip(), tuple(choices[i].strip() for i in kept),
                    tuple(kept.index(a) for a in answer))


def read_questions(path: str | Path, start: dt.date | None = None, end: dt.date | None = None) -> list[Question]:
    """The questions of a JSONL file dated from start to end (inclusive), in file order."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"question file not found: {path}")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise StreamError(f"{where}: not valid JSON ({e.msg})") from None
            q = _question(row, where)
            if (start is None or q.date >= start) and (end is None or q.date <= end):
                out.append(q)
    return out


def shots_for(question: Question, pool: list[Question], k: int) -> list[Question]:
    """k solved examples from other quizzes: the first questions of the pool dated another day."""
    return [q for q in pool if q.date != question.date][:k]


def prompt(question: Question, shots: list[Question]) -> str:
    """'Question: ...\\nAnswer: ...' for each solved example, then the question awaiting its answer."""
    solved = "".join(f"Question: {s.question}\nAnswer: {s.choices[s.answer[0]]}\n\n" for s in shots)
    return f"{solved}Question: {question.question}\nAnswer:"


def choice_sequences(lm: LM, questions: list[Question], pool: list[Question], k: int) -> list[tuple[str, list[int], int]]:
    """(id 'question#choice', context + answer tokens, first answer position) for every choice."""
    seqs = []
    for qi, q in enumerate(questions):
        context = lm.tokenizer(prompt(q, shots_for(q, pool, k)))["input_ids"]
        for ci, choice in enumerate(q.choices):
            answer = lm.tokenizer(" " + choice, add_special_tokens=False)["input_ids"]
            seqs.append((f"{qi}#{ci}", context + answer, len(context)))
    return seqs


def with_articles(lm: LM, memory, questions: list[Question], seqs: list[tuple[str, list[int], int]], room: int
                  ) -> list[tuple[str, list[int], int]]:
    """Each choice's sequence after the best article for its question among the memory's (In-Context
    RALM: the question is the query), the article cut so that the question's longest choice fits `room`."""
    found = articles_of(memory).best([q.question for q in questions])
    asked = [int(seq_id.split("#")[0]) for seq_id, _, _ in seqs]  # each sequence's question
    longest: dict[int, int] = {}
    for qi, (_, toks, _) in zip(asked, seqs):
        longest[qi] = max(longest.get(qi, 0), len(toks))
    prefixes = Prefixes(lm)
    out = []
    for qi, (seq_id, toks, first) in zip(asked, seqs):
        head = prefixes.of(found[qi], room - longest[qi])
        out.append((seq_id, head + toks, first + len(head)))
    return out


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% by default)."""
    if not n:
        return math.nan, math.nan
    p = hits / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n))


def answer_questions(lm: LM, questions: list[Question], memories: dict, shots: int = 0, pool: list[Question] | None = None,
                     cfg: ScoreConfig | None = None) -> dict:
    """Accuracy (with its 95% interval) of each memory (None: the LM alone) on the questions: the
    chosen answer is the choice with the highest mean log-probability per answer token. The LM
    runs once; its hidden states are searched in each memory."""
    cfg = cfg or ScoreConfig()
    # short answers after long prompts: small strides, the rest of the window as context
    cfg = replace(cfg, stride=32, context=cfg.context + cfg.stride - 32, batch_size=32)
    seqs = choice_sequences(lm, questions, pool if pool is not None else questions, shots)
    total: dict[str, dict[str, list[float]]] = {name: {} for name in memories}  # name -> seq id -> [sum log P, tokens]
    for memory in memories.values():
        if memory is not None:
            memory.sync()

    def add(name: str, batch: TokenScores) -> None:
        b = searched(lm, batch, memories[name])
        logp = theta_of(b, memories[name]).logp
        for seq_id in np.unique(b.doc_id):
            rows = b.doc_id == seq_id
            acc = total[name].setdefault(seq_id, [0.0, 0])
            acc[0] += float(logp[rows].sum())
            acc[1] += int(rows.sum())

    for batch in score_tokens(lm, seqs, cfg, keep_hidden=True):
        for name in (n for n, m in memories.items() if not in_context(m)):
            add(name, batch)
    for name in (n for n, m in memories.items() if in_context(m)):  # each question after its article
        room = reach(memories[name])
        for batch in score_tokens(lm, with_articles(lm, memories[name], questions, seqs, room),
                                  replace(cfg, context=room - cfg.stride), keep_hidden=memories[name].retrieves):
            add(name, batch)
    out = {}
    for name in memories:
        hits = 0
        for qi, q in enumerate(questions):
            mean = [total[name][f"{qi}#{ci}"][0] / total[name][f"{qi}#{ci}"][1] for ci in range(len(q.choices))]
            hits += int(int(np.argmax(mean)) in q.answer)
        low, high = wilson(hits, len(questions))
        out[name] = {"qa_accuracy": hits / len(questions) if questions else math.nan, "qa_n": len(questions),
                     "qa_ci_low": low, "qa_ci_high": high}
    return out
