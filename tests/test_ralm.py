"""In-Context RALM as a policy: BM25 against a brute force, the articles as of a day, forget, the
scored passes against the LM run by hand on article + text, settings recorded, and the served rows."""

import datetime as dt
import math
import re
from collections import Counter

import numpy as np
import pytest
import torch

from monim.core.config import PolicyConfig, ScoreConfig
from monim.data.day import Day
from monim.data.feed import Document
from monim.learning.memorize import memorize_day
from monim.learning.policies import make_policy
from monim.lm.model import load_lm
from monim.serving.generate import generate
from monim.serving.generation import GenerateConfig
from monim.storage.memory_settings import Settings, SettingsMismatch
from monim.theta.memory import Memory
from monim.theta.ralm import SEPARATOR, articles_of, score_with_articles
from monim.theta.retriever import Article, ArticleIndex

D1, D2 = dt.date(2022, 6, 1), dt.date(2022, 6, 2)
TEXTS = {
    "wheat": "Wheat prices rose in Chicago as drought hit the plains; traders expect wheat exports to fall.",
    "rates": "The central bank raised interest rates by half a point, its third rise as inflation climbs.",
    "storm": "A tropical storm made landfall in Florida, cutting power to homes; the storm weakened inland.",
    "chips": "Chip makers reported record sales of memory chips while a shortage of chips slowed car plants.",
    "vote": "Voters in the state chose a new governor after a close race decided by mail ballots.",
    "rates2": "Interest rates: the bank's rise lifted mortgage rates, and housing sales slowed in the spring.",
}


def brute_bm25(texts: dict[str, str], query: str, k1: float = 1.2, b: float = 0.75) -> dict[str, float]:
    """Lucene's BM25 written out: idf = ln(1 + (N - n + 0.5) / (n + 0.5)), tf / (tf + k1 (1 - b + b dl / avgdl))."""
    from bm25s.stopwords import STOPWORDS_EN

    def terms(t: str) -> list[str]:
        return [w for w in re.findall(r"\b\w\w+\b", t.lower()) if w not in set(STOPWORDS_EN)]

    docs = {i: Counter(terms(t)) for i, t in texts.items()}
    avgdl = sum(sum(c.values()) for c in docs.values()) / len(docs)
    out = {}
    for i, tf in docs.items():
        dl, score = sum(tf.values()), 0.0
        for w in set(terms(query)):
            n = sum(w in c for c in docs.values())
            if tf[w]:
                score += math.log(1 + (len(docs) - n + 0.5) / (n + 0.5)) * tf[w] / (tf[w] + k1 * (1 - b + b * dl / avgdl))
        out[i] = score
    return out


def test_bm25_picks_the_article_a_brute_force_lucene_bm25_ranks_first():
    index = ArticleIndex([Article(i, "", t, "2022-06-01") for i, t in TEXTS.items()])
    queries = ["interest rates rise", "wheat drought", "storm power Florida", "memory chips shortage cars",
               "governor race ballots", "housing mortgage rates", "the rise of the bank"]
    scores = [brute_bm25(TEXTS, q) for q in queries]
    first = [max(s, key=s.get) for s in scores]
    assert [a.id for a in index.best(queries)] == first
    assert len(set(first)) >= 5  # the queries tell the articles apart
    # an excluded article leaves the next best; a query sharing no term finds none
    second = [sorted(s, key=s.get)[-2] for s in scores]
    second = [i if s[i] > 0 else None for i, s in zip(second, scores)]
    assert [a and a.id for a in index.best(queries, [{f} for f in first])] == second and any(second)
    assert index.best(["zebra quantum"]) == [None]


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_lm(str(tiny_model_dir("llama")))


def ralm_memory(root, lm, stride=4, context=24):
    """A ralm memory that learned TEXTS over two days (wheat, rates, storm; then chips, vote, rates2)."""
    settings = Settings(window=ScoreConfig(stride=32, context=context), policy=PolicyConfig(ralm_stride=stride))
    memory = Memory(root, lm, settings)
    ids = list(TEXTS)
    for date, part in ((D1, ids[:3]), (D2, ids[3:])):
        day = Day(date, [Document(i, date, TEXTS[i], f"About {i}") for i in part], [], [])
        stats = memorize_day(memory, day, make_policy("ralm"))
        assert stats.committed and stats.stored == 0 and len(memory) == 0
    return memory


def test_retrieval_reads_the_articles_learned_through_the_day_and_never_a_forgotten_one(lm, tmp_path):
    memory = ralm_memory(tmp_path, lm)
    assert [a.id for a in articles_of(memory.at(D1)).articles] == ["wheat", "rates", "storm"]
    assert [a.id for a in articles_of(memory).articles] == list(TEXTS)
    query = ["housing mortgage rates"]
    assert [a.id for a in articles_of(memory).best(query)] == ["rates2"]
    assert [a.id for a in articles_of(memory.at(D1)).best(query)] == ["rates"]  # as of day 1: day 2's unseen
    # IDF as of the day: day 1's index counts day 1's articles only
    assert articles_of(memory.at(D1)).bm25.scores["num_docs"] == 3
    size = memory.bytes_on_disk()
    memory.forget(["rates2"])
    reread = Memory.open(tmp_path, lm)
    assert "rates2" not in {a.id for a in articles_of(reread).articles}
    assert [a.id for a in articles_of(reread).best(query)] == ["rates"]
    assert reread.bytes_on_disk() < size
    assert memorize_day(reread, Day(D2, [Document("rates2", D2, TEXTS["rates2"])], [], []),
                        make_policy("ralm")).committed is False  # a committed day stays as it is


def test_a_stride_is_scored_as_the_lm_reads_article_separator_and_text(lm, tmp_path):
    memory = ralm_memory(tmp_path, lm, stride=4, context=6)
    doc = Document("t", D2, "Mortgage rates rose again as the central bank raised interest rates; wheat and chips fell.")
    toks = lm.tokenizer(doc.text)["input_ids"]
    ralm = score_with_articles(lm, memory, [doc], [toks])
    got = {int(p): float(v) for b in ralm.batches for p, v in zip(b.position, b.logp)}
    assert sorted(got) == list(range(1, len(toks)))
    index, sep = articles_of(memory), lm.tokenizer(SEPARATOR, add_special_tokens=False)["input_ids"]
    size = 6 + 32 + 6  # the window (context 6, stride 32) and an article of up to 6 tokens
    for n, s in enumerate(range(1, len(toks), 4)):
        e, p = min(s + 4, len(toks)), max(0, s - 1 - (6 + 32 - 4))  # the text the LM alone would read
        article = index.best([lm.tokenizer.decode(toks[max(0, s - 32):s])])[0]
        assert ralm.retrieved["t"][n] == (article.id if article else "")
        head = lm.tokenizer(f"{article.title}\n{article.text}", add_special_tokens=False)["input_ids"] if article else []
        head = head[: size + 1 - (e - p) - len(sep)] + sep if article else []
        assert len(head) + e - p - 1 <= size
        ids = torch.tensor([head + toks[p:e]])
        with torch.no_grad():
            logp = torch.log_softmax(lm.model(ids).logits[0].float(), -1)
        for t in range(s, e):
            j = len(head) + t - p
            assert got[t] == pytest.approx(float(logp[j - 1, toks[t]]), abs=1e-4)
    assert any(ralm.retrieved["t"]) and ralm.lm_tokens / ralm.scored > 4  # every stride reads its article again


def test_evaluation_scores_every_token_once_with_the_lm_alone_beside_it(lm, tmp_path):
    """Even where the window leaves no context before a stride (a model of few positions), each token is
    scored once, and the LM alone's numbers are the bare LM's."""
    from monim.evaluation.evaluate import evaluate_many

    docs = [Document(f"t{i}", D2, TEXTS[k] + " " + TEXTS["vote"]) for i, k in enumerate(("rates2", "storm"))]
    for context in (24, 0):
        memory = ralm_memory(tmp_path / str(context), lm, stride=8, context=context)
        r = evaluate_many(lm, docs, {"bare": None, "ralm": memory})
        assert r["ralm"]["tokens"] == r["bare"]["tokens"] == sum(len(lm.tokenizer(d.text)["input_ids"]) - 1 for d in docs)
        assert r["ralm"]["ppl_lm"] == pytest.approx(r["bare"]["ppl"]) and r["ralm"]["ppl"] != pytest.approx(r["bare"]["ppl"])
        assert r["ralm"]["lm_tokens_per_token"] > 1


def test_scored_training_text_never_retrieves_itself_or_its_twin(lm, tmp_path):
    memory = ralm_memory(tmp_path, lm)
    twin = "Wheat prices rose in Chicago as drought hit the plains; traders expect wheat exports to fall sharply."
    day = Day(dt.date(2022, 6, 3), [Document("wheat-copy", dt.date(2022, 6, 3), twin)], [], [])
    memorize_day(memory, day, make_policy("ralm"))
    wheat = Document("wheat", D1, TEXTS["wheat"])
    ralm = score_with_articles(lm, memory, [wheat], [lm.tokenizer(wheat.text)["input_ids"]])
    assert ralm.retrieved["wheat"] and not {"wheat", "wheat-copy"} & set(ralm.retrieved["wheat"])
    unseen = Document("new", D2, TEXTS["wheat"].replace("Chicago", "Kansas"))  # text the memory never learned
    ralm = score_with_articles(lm, memory, [unseen], [lm.tokenizer(unseen.text)["input_ids"]])
    assert {"wheat", "wheat-copy"} & set(ralm.retrieved["new"])


def test_a_ralm_memory_records_its_settings_and_refuses_others(lm, tmp_path):
    ralm_memory(tmp_path, lm, stride=8)
    with pytest.raises(SettingsMismatch, match="policy.ralm_stride"):
        Memory(tmp_path, lm, Settings(window=ScoreConfig(stride=32, context=24), policy=PolicyConfig(ralm_stride=16)))
    assert Memory.open(tmp_path, lm).settings.policy.ralm_stride == 8


def test_generation_puts_the_best_article_before_the_prompt_and_names_it(lm, tmp_path):
    memory = ralm_memory(tmp_path, lm)
    cfg = GenerateConfig(max_new_tokens=4)
    gen = generate(lm, "Memory chips shortage", memory, cfg)
    assert gen.sources == [{"date": "2022-06-02", "doc_id": "chips", "title": "About chips"}]
    article = lm.tokenizer("About chips\n" + TEXTS["chips"], add_special_tokens=False)["input_ids"]
    sep = lm.tokenizer(SEPARATOR, add_special_tokens=False)["input_ids"]
    ids = article[: 24 + 32 + 24 - 4 - len(sep) - 3] + sep + lm.tokenizer("Memory chips shortage")["input_ids"]
    with torch.no_grad():  # greedy by hand over the same context
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):].tolist()
    assert gen.tokens == out
    plain = generate(lm, "Memory chips shortage", None, cfg)
    assert plain.sources == []
    with pytest.raises(ValueError, match="retrieve needs a memory"):
        generate(lm, "x y", None, GenerateConfig(max_new_tokens=2, retrieve=True))


def test_a_served_prompt_row_that_asks_retrieves_and_names_its_article_beside_one_that_does_not(lm, tmp_path):
    from monim.serving.service import Service

    plain = Memory(tmp_path / "plain", lm, Settings(window=ScoreConfig(stride=32, context=24)))
    day = Day(D1, [Document(i, D1, TEXTS[i], f"About {i}") for i in ("wheat", "chips")], [], [])
    memorize_day(plain, day, make_policy("fullmem"))
    service = Service(plain)
    try:
        answers = service.answer({"dataframe_records": [{"prompt": "Memory chips shortage", "retrieve": True},
                                                        {"prompt": "Memory chips shortage"}],
                                  "params": {"max_new_tokens": 3}})
    finally:
        service.close()
    assert answers[0]["sources"] == [{"date": "2022-06-01", "doc_id": "chips", "title": "About chips"}]
    assert answers[1]["sources"] == []
    alone = generate(lm, "Memory chips shortage", plain, GenerateConfig(max_new_tokens=3, retrieve=True))
    assert answers[0]["tokens"] == alone.tokens


def test_served_rows_ask_for_retrieval_by_name():
    from monim.serving.service import BadRequest, Limits, parse

    request = parse({"dataframe_records": [{"prompt": "a b", "retrieve": True}, {"prompt": "c d"}]}, Limits())
    assert request.retrieve == {0}
    with pytest.raises(BadRequest, match=r"dataframe_records\[0\].retrieve"):
        parse({"dataframe_records": [{"text": "a b", "retrieve": True}]}, Limits())
    with pytest.raises(BadRequest, match=r"dataframe_records\[0\].retrieve"):
        parse({"dataframe_records": [{"prompt": "a b", "retrieve": "yes"}]}, Limits())
    assert np.array_equal(np.array(sorted(request.retrieve)), [0])
