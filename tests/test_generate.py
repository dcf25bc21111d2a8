"""Generation from Θ against an independent reference (the HF model run on the whole prefix, numpy
neighbours), the real LM continuing a memorized article, and recency at query time."""

import datetime as dt
import itertools
import math

import numpy as np
import pytest
import torch

from helpers import first_words, learned_memory, words_continued
from monim.core.config import DEMO_STREAM
from monim.core.recency import Recency
from monim.data.day import Day
from monim.data.feed import open_feed
from monim.data.stream import iter_days
from monim.learning.memorize import memorize_day
from monim.learning.policies import make_policy
from monim.lm.host import reads
from monim.lm.model import load_lm
from monim.lm.token_scores import OnDevice
from monim.serving.generate import Decoder, _choose, generate
from monim.serving.generation import GenerateConfig
from monim.serving.sentences import sentences
from monim.storage.entries import Entries
from monim.storage.index import IndexConfig
from monim.storage.memory_settings import Settings
from monim.theta.memory import Memory

K, LAM, T = 8, 0.4, 3.0


@pytest.fixture(scope="module")
def stream():
    return list(iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 2), dt.date(1987, 3, 3)))


def constant_theta(memory: Memory, lam: float, temperature: float) -> None:
    """Θ's constant λ and T, set by hand (no calibration)."""
    memory.ds.commits.set_theta({"date": memory.ds.days[-1].date, "lam": lam, "temperature": temperature})


def reference_step(lm, prefix: list[int], keys: np.ndarray, values: np.ndarray, vocab: int) -> np.ndarray:
    """Θ's next-token log P after `prefix`, computed independently: the HF model on the whole prefix
    (no cache), the key from a hook of its own, exact numpy neighbours, softmax(-d/T), the mixture."""
    captured = {}
    hook = lm.model.model.layers[-1].mlp.register_forward_pre_hook(lambda m, a: captured.update(key=a[0]))
    try:
        with torch.no_grad():
            logits = lm.model(torch.tensor([prefix])).logits[0, -1].double()
    finally:
        hook.remove()
    p_lm = torch.softmax(logits, -1).numpy()
    q = captured["key"][0, -1].to(torch.float16).double().numpy()
    d = ((keys - q) ** 2).sum(1)
    nn = np.argsort(d)[:K]
    w = np.exp(-(d[nn] - d[nn].min()) / T)
    p_knn = np.zeros(vocab)
    np.add.at(p_knn, values[nn], w / w.sum())
    return np.log((1 - LAM) * p_lm + LAM * p_knn)


def test_each_step_is_the_interpolation_computed_independently(tiny, stream, tmp_path):
    memory = Memory(tmp_path, tiny, Settings(calibrated=False, index=IndexConfig(k=K)))
    memorize_day(memory, stream[0].capped(2), make_policy("fullmem"))
    constant_theta(memory, LAM, T)
    keys = memory.ds.shards.array("keys").astype(np.float64)
    values = memory.ds.shards.array("values")
    prompt = stream[0].train[0].text[:80]
    for cfg in (GenerateConfig(max_new_tokens=6, keep_distributions=True),
                GenerateConfig(max_new_tokens=6, temperature=0.9, top_p=0.8, seed=3, keep_distributions=True)):
        gen = generate(tiny, prompt, memory, cfg)
        assert len(gen.logprobs) == len(gen.tokens) == 6 and all(lam == LAM for lam in gen.lams)
        prefix = tiny.tokenizer(prompt)["input_ids"]
        for step, token in enumerate(gen.tokens):
            want = reference_step(tiny, prefix, keys, values, len(gen.logprobs[step]))
            np.testing.assert_allclose(np.exp(gen.logprobs[step]), np.exp(want), atol=2e-5)
            if cfg.temperature == 0:
                assert token == int(np.argmax(want))
            prefix = prefix + [token]
    # sources: the memorized training articles, with their day and title
    sources = [s for sentence in gen.sentences for s in sentence["sources"]]
    assert sources and {s["doc_id"] for s in sources} <= {d.id for d in stream[0].train[:2]}
    assert {s["date"] for s in sources} == {"1987-03-02"} and all(s["title"] and s["weight"] > 0 for s in sources)
    assert "".join(s["text"] for s in gen.sentences) == gen.text


class ExactOnDevice(OnDevice):
    """A memory held on the device as tensors and searched there by an exact scan, Θ's constant λ:
    what monim.theta.device.DeviceTheta gives a Decoder (tensors in and out)."""

    def __init__(self, memory: Memory):
        self.keys, self.values, self.ids = (torch.from_numpy(memory.ds.shards.array(a)) for a in ("keys", "values", "ids"))
        self.interpolation = memory.interpolation

    def search(self, chunk, rows=None):
        dist, at = ((chunk["key"].float()[:, None] - self.keys.float()[None]) ** 2).sum(-1).topk(K, largest=False)
        return dict(knn_dist=dist, knn_values=self.values[at], knn_ids=self.ids[at])

    def lam(self, chunk):
        return torch.tensor(self.interpolation.lam, dtype=torch.float64)


def test_with_the_memory_on_the_device_a_step_reads_the_chosen_tokens_only(tiny, stream, tmp_path):
    """A memory searched on the device: each step reads the chosen tokens once, with what the rows keep
    of it (λ, credit, distributions); rows greedy and sampled write what they write with the memory searched on the
    host (the same tokens, λ, distributions and sources), Θ's step the independent reference's."""
    memory = Memory(tmp_path, tiny, Settings(calibrated=False, index=IndexConfig(k=K)))
    memorize_day(memory, stream[0].capped(2), make_policy("fullmem"))
    constant_theta(memory, LAM, T)
    prompts = [stream[0].train[0].text[:80], "The bank said on", stream[0].train[1].text[:50]]
    cfgs = [GenerateConfig(max_new_tokens=6, keep_distributions=True), GenerateConfig(max_new_tokens=4),
            GenerateConfig(max_new_tokens=5, temperature=0.9, top_p=0.8, seed=3, keep_distributions=True)]
    on_device, on_host = Decoder(tiny, memory, on_device=ExactOnDevice(memory)), Decoder(tiny, memory)
    rows, counts = [on_device.add(p, c) for p, c in zip(prompts, cfgs)], []
    alone = [on_host.add(p, c) for p, c in zip(prompts, cfgs)]
    while on_device:
        with reads() as counted:
            on_device.advance()
        counts.append(dict(counted))
        kept = [x for r in rows for x in (*r.lams, *r.logprobs, *(w for c in r.credit for w in (*c, *c.values())))]
        assert kept and not any(isinstance(x, torch.Tensor) for x in kept)  # host copies: nothing of a step held on the device
    while on_host:
        on_host.advance()
    assert all(c == {"to_host": 1} for c in counts)  # none more when a row ends
    for row, there in zip(rows, alone):
        mine, theirs = row.result, there.result
        assert mine.tokens == theirs.tokens and len(mine.sentences) == len(theirs.sentences)
        for a, b in zip(mine.sentences, theirs.sentences):  # the kNN weights carried: distances to float32's precision
            assert a["text"] == b["text"] and [s["doc_id"] for s in a["sources"]] == [s["doc_id"] for s in b["sources"]]
            np.testing.assert_allclose([s["weight"] for s in a["sources"]], [s["weight"] for s in b["sources"]], rtol=1e-6)
        np.testing.assert_allclose(mine.lams, theirs.lams)
        for a, b in zip(mine.logprobs or [], theirs.logprobs or []):
            np.testing.assert_allclose(np.exp(a), np.exp(b), atol=1e-6)
    keys, values = memory.ds.shards.array("keys").astype(np.float64), memory.ds.shards.array("values")
    prefix = tiny.tokenizer(prompts[0])["input_ids"]
    for token, logp in zip(rows[0].result.tokens, rows[0].result.logprobs):
        want = reference_step(tiny, prefix, keys, values, len(logp))
        np.testing.assert_allclose(np.exp(logp), np.exp(want), atol=2e-5)
        assert token == int(np.argmax(want))
        prefix = prefix + [token]


def test_bad_generation_requests_are_refused(tiny):
    with pytest.raises(ValueError, match="empty"):
        generate(tiny, "")
    with pytest.raises(ValueError, match="positions"):
        generate(tiny, "word " * 300)
    with pytest.raises(ValueError, match="top_p"):
        GenerateConfig(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        GenerateConfig(temperature=float("nan"))
    with pytest.raises(ValueError, match="sources"):
        GenerateConfig(sources=-1)


def test_nucleus_sampling_draws_from_the_smallest_prefix_reaching_top_p():
    """P = (0.5, 0.3, 0.15, 0.05), top_p 0.7: only the first two, in proportion 5:3."""
    logp = torch.tensor([0.15, 0.5, 0.05, 0.3], dtype=torch.float64).log()
    rng = torch.Generator().manual_seed(0)
    counts = np.bincount([int(_choose(logp, GenerateConfig(temperature=1.0, top_p=0.7), rng)) for _ in range(2000)],
                         minlength=4)
    assert counts[0] == counts[2] == 0 and abs(counts[1] / 2000 - 0.625) < 0.04
    assert int(_choose(logp, GenerateConfig(), rng)) == 1  # greedy
    # the draw torch.multinomial makes from the same generator (without its check that reads the device)
    wide, cfg = torch.log_softmax(torch.linspace(-3, 3, 500, dtype=torch.float64).sin() * 4, -1), GenerateConfig(temperature=0.8, top_p=0.9)
    probs = torch.softmax(wide / cfg.temperature, -1)
    order = probs.argsort(descending=True)
    nucleus = probs[order] * (probs[order].cumsum(0) - probs[order] < cfg.top_p)
    for seed in range(50):
        drawn = torch.multinomial(nucleus / nucleus.sum(), 1, generator=torch.Generator().manual_seed(seed))
        assert int(_choose(wide, cfg, torch.Generator().manual_seed(seed))) == int(order[drawn])


def test_recency_weights_neighbours_by_age_and_drops_old_days(tiny, tmp_path):
    """Entries of three days 10 days apart; a query's neighbours weighted 2^(-age/h) against numpy,
    and a maximum age that leaves the oldest day out of the search."""
    rng = np.random.default_rng(0)
    d = tiny.hidden_size
    memory = Memory(tmp_path, tiny, Settings(calibrated=False, index=IndexConfig(k=8)))
    keys = rng.standard_normal((3, 4, d)).astype(np.float16)
    for i, date in enumerate(("2022-06-01", "2022-06-11", "2022-06-21")):
        memory.ds.commits.commit_day(date, Entries(keys[i], np.arange(4, dtype=np.int32) + 10 * i, [f"doc{i}"] * 4,
                                           np.arange(4, dtype=np.int32)), 4, "fullmem")
    memory.sync()
    queries = keys.reshape(12, d)[[0, 5, 10]].astype(np.float32)
    from monim.lm.token_scores import TokenScores

    batch = TokenScores(np.array(["q"] * 3, object), *(np.zeros(3, np.int32),) * 3, *(np.zeros(3, np.float32),) * 3,
                        np.zeros(3, np.int32), queries.astype(np.float16))
    found = memory.recent(Recency(half_life=5.0)).search(batch)
    day_of = found.ids // 4  # ids 0-3: the first day, 4-7: the second, 8-11: the third
    np.testing.assert_allclose(found.prior, -math.log(2) / 5.0 * (20 - 10 * day_of), rtol=1e-6)
    assert memory.search(batch).prior is None
    recent = memory.recent(Recency(max_age=10)).search(batch)
    assert set(recent.ids.ravel()) == set(range(4, 12))  # the first day (20 days old) is not searched
    past = memory.at("2022-06-11").recent(Recency(max_age=0)).search(batch)
    assert set(past.ids.ravel()) - {-1} == set(range(4, 8))  # ages count from the day it is read as of
    with pytest.raises(ValueError, match="half_life"):
        Recency(half_life=0)


def test_a_headline_stored_whole_is_cited_cut(tiny, tmp_path):
    """A memory written before titles were capped at ingest holds a 1,000,000-character headline: the
    sources of a continuation name it cut to TITLE_CAP characters (a 12-token answer is not 2 MB)."""
    from monim.data.feed import TITLE_CAP
    from monim.serving.sentences import entry_articles

    memory = Memory(tmp_path, tiny, Settings(calibrated=False))
    keys = np.random.default_rng(0).standard_normal((3, tiny.hidden_size)).astype(np.float16)
    memory.ds.commits.commit_day("2022-06-01", Entries(keys, np.arange(3, dtype=np.int32), ["a", "a", "b"],
                                               np.arange(3, dtype=np.int32)), 3, "fullmem", titles={"a": "x" * 10**6, "b": "B"})
    found = entry_articles(memory, [0, 2])
    assert found[0] == ("2022-06-01", "a", "x" * (TITLE_CAP - 1) + "…") and found[2] == ("2022-06-01", "b", "B")


def test_a_narrow_window_of_an_ivfpq_memory_is_searched_exactly(tiny, tmp_path):
    """IVF-PQ probes nprobe of its lists, which may hold few of a recent window's entries: within
    a maximum age the window's stored keys are searched exactly (numpy reference)."""
    rng = np.random.default_rng(1)
    d = tiny.hidden_size
    memory = Memory(tmp_path, tiny, Settings(calibrated=False, index=IndexConfig(k=16, exact_below=1500, code_bytes=4, nprobe=1)))
    days = ("2022-06-01", "2022-06-05", "2022-06-06")
    keys = [rng.standard_normal((n, d)).astype(np.float16) for n in (1600, 40, 30)]
    for date, k in zip(days, keys):
        memory.ds.commits.commit_day(date, Entries(k, rng.integers(0, 100, len(k)).astype(np.int32), ["doc"] * len(k),
                                           np.arange(len(k), dtype=np.int32)), len(k), "fullmem")
    memory.sync()
    assert memory.index.meta["kind"] == "ivfpq"
    queries = rng.standard_normal((5, d)).astype(np.float32)
    dist, ids = memory.recent(Recency(max_age=1)).nearest(queries, 16)
    window = np.concatenate(keys[1:]).astype(np.float32)  # ids 1600..1669, the last two days
    want = ((queries[:, None] - window[None]) ** 2).sum(-1)
    order = np.argsort(want, 1)[:, :16]
    np.testing.assert_array_equal(ids, 1600 + order)
    np.testing.assert_allclose(dist, np.take_along_axis(want, order, 1), rtol=1e-4)
    dist, ids = memory.recent(Recency(max_age=0)).nearest(queries, 64)  # fewer entries than k: the rest is -1
    assert set(ids[ids >= 0]) == set(range(1640, 1670)) and (ids[:, 30:] == -1).all() and np.isinf(dist[:, 30:]).all()


@pytest.mark.slow
def test_the_real_lm_continues_a_memorized_article_word_for_word(smollm, stream, tmp_path):
    """FullMem learns one article; from its first line, greedy Θ (λ = 0.5) writes its next 30 tokens
    as they are, where the bare LM does not, and names the article as the source."""
    doc = stream[0].train[0]
    memory = Memory(tmp_path, smollm, Settings(calibrated=False))
    memorize_day(memory, Day(stream[0].date, [doc], [], []), make_policy("fullmem"))
    constant_theta(memory, 0.5, 1.0)
    prompt = doc.text.split("\n")[0]
    tokens = smollm.tokenizer(doc.text)["input_ids"]
    start = len(smollm.tokenizer(prompt)["input_ids"])
    assert tokens[:start] == smollm.tokenizer(prompt)["input_ids"]
    cfg = GenerateConfig(max_new_tokens=30)
    with_memory, bare = generate(smollm, prompt, memory, cfg), generate(smollm, prompt, None, cfg)
    assert with_memory.tokens == tokens[start : start + 30]
    assert bare.tokens[:10] != tokens[start : start + 10]
    assert {s["doc_id"] for sentence in with_memory.sentences for s in sentence["sources"]} == {doc.id}
    assert with_memory.sentences[0]["sources"][0]["title"] == doc.title == "STRONG EARTHQUAKE HITS NEW ZEALAND"


def test_a_full_batch_lets_waiting_prompts_in_first_come_first_in(tiny):
    """At most 2 rows and 40 cached tokens (rows × the longest context): the third prompt (26 tokens)
    waits until the batch is empty, the fourth behind it; each writes what it writes alone."""
    prompts = ["The bank said on", "Oil prices rose on", " ".join(["shares"] * 25), "Tokyo"]
    assert [len(tiny.tokenizer(p)["input_ids"]) for p in prompts] == [4, 4, 26, 2]
    cfgs = [GenerateConfig(max_new_tokens=n) for n in (3, 8, 4, 3)]
    decoder = Decoder(tiny, None, max_rows=2, max_cells=40)
    rows, batches = [decoder.add(p, c) for p, c in zip(prompts, cfgs)], []
    while decoder:
        decoder.advance()
        batches.append([rows.index(r) for r in decoder.active])
    assert batches == [[0, 1]] * 2 + [[1]] * 5 + [[]] + [[2]] * 3 + [[]] + [[3]] * 2 + [[]]
    assert [r.result.tokens for r in rows] == [generate(tiny, p, None, c).tokens for p, c in zip(prompts, cfgs)]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_a_decoding_step_reads_the_chosen_tokens_only(arch, tiny_model_dir, monkeypatch):
    """Rows of other lengths (a padded cache: the mask monim builds), greedy and sampled, joining and
    leaving: each step reads the chosen tokens once, with what the rows keep (none more when rows end);
    greedy rows write the top token of the HF model run on the whole prefix, sampled ones what they
    write alone. An `.item()` added to a step is counted."""
    tiny = load_lm(str(tiny_model_dir(arch)))
    prompts = ["The bank said on", " ".join(["shares"] * 12), "Tokyo", "Oil prices rose sharply on"]
    cfgs = [GenerateConfig(max_new_tokens=5), GenerateConfig(max_new_tokens=4, temperature=0.8, top_p=0.9, seed=2),
            GenerateConfig(max_new_tokens=6), GenerateConfig(max_new_tokens=3, temperature=1.2, seed=5)]
    decoder = Decoder(tiny, None, max_rows=3)
    rows, counts = [decoder.add(p, c) for p, c in zip(prompts, cfgs)], []
    while decoder:
        with reads() as counted:
            ended = decoder.advance()
        counts.append((dict(counted), len(ended)))
    assert all(c == {"to_host": 1} for c, _ in counts) and sum(n for _, n in counts) == 4  # none more when a row ends
    for row, cfg in zip(rows, cfgs):
        if cfg.temperature == 0:
            prefix = tiny.tokenizer(row.prompt)["input_ids"]
            for token in row.result.tokens:
                with torch.no_grad():
                    assert token == int(tiny.model(torch.tensor([prefix])).logits[0, -1].argmax())
                prefix = prefix + [token]
        else:
            assert row.result.tokens == generate(tiny, row.prompt, None, cfg).tokens
    logits = tiny.logits
    monkeypatch.setattr(tiny, "logits", lambda h: (logits(h).max().item(), logits(h))[1])
    decoder.add("The bank said on")
    with reads() as counted:
        decoder.advance()
    assert counted == {"to_host": 1, "item": 1}


def test_in_bfloat16_prompts_are_decoded_one_after_another(tiny_model_dir):
    """bfloat16's rounding would make a row's tokens depend on what it is batched with: an LM in
    bfloat16 decodes one row at a time (the next waits), each writing what it writes alone."""
    lm = load_lm(str(tiny_model_dir("llama")), dtype="bfloat16")
    prompts, cfg = ["The bank said on", "Oil prices rose on", "Tokyo"], GenerateConfig(max_new_tokens=3)
    decoder, batches = Decoder(lm), []
    rows = [decoder.add(p, cfg) for p in prompts]
    while decoder:
        decoder.advance()
        batches.append(len(decoder.active))
    assert batches == [1, 1, 0] * 3
    assert [r.result.tokens for r in rows] == [generate(lm, p, None, cfg).tokens for p in prompts]


@pytest.fixture(scope="module")
def trusted(smollm, stream, tmp_path_factory):
    """FullMem's first day of 3 articles, calibrated on them (the real LM): its memory and its day."""
    day = stream[0].capped(3)
    return learned_memory(tmp_path_factory.mktemp("trusted"), smollm, [day]), day


@pytest.mark.slow
def test_a_memory_is_trusted_from_its_first_day(smollm, trusted):
    """Cold start: FullMem learns 3 articles on its first day and calibrates on them (its calibration
    sees contexts the memory holds as well as new text); greedy Θ continues each learned article from
    its first 25 words for at least 8 words, where the LM alone does not."""
    memory, day = trusted
    assert memory.rule != "lm"
    cfg = GenerateConfig(max_new_tokens=16)
    for doc in day.train:
        prompt = first_words(doc.text, 25)
        assert words_continued(doc.text, prompt, generate(smollm, prompt, memory, cfg).text) >= 8, doc.id
    assert min(words_continued(d.text, first_words(d.text, 25), generate(smollm, first_words(d.text, 25), None, cfg).text)
               for d in day.train) < 8  # the LM alone does not know them


@pytest.mark.slow
def test_prompts_decoded_together_write_what_each_writes_alone(trusted):
    """Six prompts (greedy and sampled) in one decoder: three join at once (prefilled together, padded
    to the longest), three more two steps later (a long one prefilled apart), and they leave as they
    end or are stopped (the third after 4 tokens): each writes the tokens it writes alone, with λ (the
    calibrator's, per token), its log P and Θ's P over the vocabulary within 1e-4."""
    memory, day = trusted
    prompts = [first_words(d.text, n) for d, n in zip(day.train * 2, (6, 8, 7, 40, 9, 6))]
    cfgs = [GenerateConfig(max_new_tokens=6 + 2 * i, temperature=0.8 * (i % 2), top_p=0.9, seed=i,
                           keep_distributions=True) for i in range(len(prompts))]
    looks = itertools.count()
    stops = [None, None, lambda: "enough" if next(looks) == 4 else None, None, None, None]
    alone = [generate(memory.lm, p, memory, c) for p, c in zip(prompts, cfgs)]
    decoder, sizes = Decoder(memory.lm, memory), []
    rows = [decoder.add(p, c, stop) for p, c, stop in zip(prompts[:3], cfgs[:3], stops[:3])]
    for _ in range(2):
        decoder.advance()
        sizes.append(len(decoder.active))
    rows += [decoder.add(p, c, stop) for p, c, stop in zip(prompts[3:], cfgs[3:], stops[3:])]
    while decoder:
        decoder.advance()
        sizes.append(len(decoder.active))
    assert len({len(r.ids) for r in rows[:3]}) == 3 and sizes[:3] == [3, 3, 6]  # joined at once, then three more
    assert sizes[-1] == 0 and len(set(sizes)) == 7  # left one by one while the others went on
    assert len({round(float(np.mean(r.result.lams)), 3) for r in rows}) > 1  # λ differs from prompt to prompt
    for i, (a, row) in enumerate(zip(alone, rows)):
        b = row.result
        assert (b.stopped, b.tokens) == (("enough", a.tokens[:4]) if i == 2 else (a.stopped, a.tokens)), i
        np.testing.assert_allclose(b.lams, a.lams[: len(b.lams)], atol=1e-4, rtol=0)
        mine, theirs = np.stack(b.logprobs), np.stack(a.logprobs[: len(b.logprobs)])
        np.testing.assert_allclose(np.exp(mine), np.exp(theirs), atol=1e-4, rtol=0)
        chosen = np.arange(len(b.tokens)), b.tokens
        np.testing.assert_allclose(mine[chosen], theirs[chosen], atol=1e-4, rtol=0)


def test_sentences_end_at_a_mark_before_a_space_not_inside_a_number(tiny):
    text = "Exports rose to 2.277 billion dlrs in the U.S. market. Imports fell!\nThe yen"
    tokens = tiny.tokenizer(text)["input_ids"]
    cut = sentences(tiny, None, tokens, [{}] * len(tokens), 3)
    assert [s["text"] for s in cut] == ["Exports rose to 2.277 billion dlrs in the U.S.", " market.", " Imports fell!",
                                              "\nThe yen"]


@pytest.mark.parametrize("reading", [dict(skip_threshold=0.5), dict(half_life=1.0)])
def test_the_served_decoder_with_the_real_device_theta_writes_what_the_host_path_writes(theta, reading):
    """The Decoder with the memory held on the device by Memory.on_device (a calibrated Θ, its skip
    rule or a recency prior) writes the tokens, λ and sources the host path writes, one read a step."""
    memory = Memory.open(theta.ds.root, theta.lm, **reading)
    prompts = ["The company said on Monday", "Shares of the bank"]
    cfgs = [GenerateConfig(max_new_tokens=6, keep_distributions=True), GenerateConfig(max_new_tokens=4)]
    on_device, on_host = Decoder(theta.lm, memory, on_device=memory.on_device()), Decoder(theta.lm, memory)
    rows, alone = [on_device.add(p, c) for p, c in zip(prompts, cfgs)], [on_host.add(p, c) for p, c in zip(prompts, cfgs)]
    while on_device:
        with reads() as counted:
            on_device.advance()
        assert dict(counted) == {"to_host": 1}  # the step's read holds what the rows keep: none more when one ends
    while on_host:
        on_host.advance()
    for row, there in zip(rows, alone):
        assert row.result.tokens == there.result.tokens
        np.testing.assert_allclose(row.result.lams, there.result.lams, rtol=1e-5, atol=1e-6)
        for a, b in zip(row.result.logprobs or [], there.result.logprobs or []):
            np.testing.assert_allclose(np.exp(a), np.exp(b), atol=1e-5)


def test_a_memory_on_the_device_given_alone_decodes_theta_without_sources(theta):
    """Decoder(lm, None, on_device=...) (benchmarks/gpu.py's Θ, where no Memory can be opened) writes the
    tokens and λ the Decoder with the memory writes, its sentences citing nothing."""
    memory = Memory.open(theta.ds.root, theta.lm)
    prompt, cfg = "The company said on Monday", GenerateConfig(max_new_tokens=6)
    alone, held = Decoder(theta.lm, None, on_device=memory.on_device()), Decoder(theta.lm, memory)
    rows = [alone.add(prompt, cfg), held.add(prompt, cfg)]
    for decoder in (alone, held):
        while decoder:
            decoder.advance()
    a, b = (row.result for row in rows)
    assert a.tokens == b.tokens and any(lam > 0 for lam in a.lams)
    np.testing.assert_allclose(a.lams, b.lams, rtol=1e-5, atol=1e-6)
    assert all(not s["sources"] for s in a.sentences)
