"""Parametric learners (fine-tune, Mix-Review, RecAdam): the updates against hand-computed ones,
the day's weights committed atomically, and the flows running them like any policy."""

import datetime as dt
import json
import math

import numpy as np
import pytest
import torch

from monim.core.config import DEMO_STREAM
from monim.core.run_config import RunConfig
from monim.data.feed import Document
from monim.learning.parametric import Learner, Weights, blocks, load_day, train_day, trained_copy


def doc(text: str, i: int = 0) -> Document:
    return Document(f"d{i}", dt.date(2022, 6, 1), text)


def test_learner_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="unknown parametric method"):
        Learner(method="sgd")
    with pytest.raises(ValueError, match="mix-review needs general-domain text"):
        Learner(method="mix-review")
    with pytest.raises(ValueError, match="review text not found"):
        Learner(method="mix-review", review=str(tmp_path / "nope.txt"))
    assert Learner(method="mix-review", review=__file__, mix_ratio=2.0, mix_decay=0.5).review_share(3) == 2.0 * 0.5**3
    assert Learner().review_share(0) == 0.0
    rec = Learner(method="recadam", anneal_k=0.5, anneal_t0=10)
    assert rec.anneal(10) == 0.5 and rec.anneal(0) == pytest.approx(1 / (1 + math.exp(5)))
    assert Learner().anneal(0) == 1.0


def test_blocks_cut_the_first_tokens():
    assert blocks([[1, 2, 3], [4, 5, 6, 7]], 3, 6) == [[1, 2, 3], [4, 5, 6]]
    assert blocks([[1, 2, 3], [4]], 3, None) == [[1, 2, 3]]  # a one-token tail predicts nothing


def _nll(lm, text: str) -> float:
    ids = torch.tensor([lm.tokenizer(text)["input_ids"]])
    with torch.no_grad():
        return float(lm.model(input_ids=ids, labels=ids).loss)


def test_fine_tuning_learns_the_day_and_leaves_the_base_alone(tiny):
    text = "The central bank raised its key interest rate by half a point on Tuesday. " * 6
    lm = trained_copy(tiny)
    before = _nll(lm, text)
    stats = train_day(lm, [doc(text)], Learner(lr=1e-2, train_block=32, train_batch=2, epochs=5, train_tokens=None), 0, 0)
    n = len(tiny.tokenizer(text)["input_ids"])
    assert stats["tokens_trained"] == n - n % 32 + (n % 32 if n % 32 >= 2 else 0)
    assert stats["steps"] == 5 * math.ceil(math.ceil(n / 32) / 2) and stats["step"] == stats["steps"]
    assert _nll(lm, text) < before - 1.0
    assert _nll(tiny, text) == pytest.approx(before)  # the frozen LM is untouched


def test_recadam_step_matches_the_hand_computed_update(tiny):
    """One RecAdam step from θ*: Adam's first step is lr·λ·g/(|g|+eps), then the pull
    lr·(1-λ)·γ·(θ-θ*) toward θ*, so θ1 = θ* - lr·λ·g/(|g|+eps)·(1 - lr·(1-λ)·γ)."""
    text = "Oil prices rose sharply after the announcement. " * 3
    learner = Learner(method="recadam", lr=1e-3, train_block=16, train_batch=1, train_tokens=16, pretrain_coef=50.0,
                      anneal_k=0.5, anneal_t0=2)
    ref = trained_copy(tiny)
    ids = torch.tensor([tiny.tokenizer(text)["input_ids"][:16]])
    ref.model.train()
    ref.model(input_ids=ids, labels=ids).loss.backward()
    lm = trained_copy(tiny)
    pretrained = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    train_day(lm, [doc(text)], learner, 0, 0, pretrained)
    lam = 1 / (1 + math.exp(-0.5 * (0 - 2)))
    for name, p in lm.model.named_parameters():
        g = dict(ref.model.named_parameters())[name].grad
        if g is None:
            continue
        want = pretrained[name] - 1e-3 * lam * g / (g.abs() + 1e-8) * (1 - 1e-3 * (1 - lam) * 50.0)
        torch.testing.assert_close(p.detach(), want, atol=1e-6, rtol=1e-4)


def test_mix_review_mixes_decaying_general_text(tiny, tmp_path):
    review = tmp_path / "general.txt"
    review.write_text("Wikipedia is a free online encyclopedia written by volunteers around the world. " * 50)
    text = "Stocks fell on Wall Street as investors weighed the latest inflation data. " * 16
    learner = Learner(method="mix-review", review=str(review), lr=1e-4, train_block=32, train_batch=4, train_tokens=128,
                      mix_ratio=2.0, mix_decay=0.5)
    first = train_day(trained_copy(tiny), [doc(text)], learner, 0, 0)
    third = train_day(trained_copy(tiny), [doc(text)], learner, 2, 0)
    assert first["tokens_trained"] == third["tokens_trained"] == 128
    assert first["review_tokens"] == 2.0 * 128  # 8 blocks of 32 general-domain tokens
    assert third["review_tokens"] == 2.0 * 0.25 * 128


def test_weights_round_trip_and_a_stray_is_no_day(tiny, tmp_path):
    lm = trained_copy(tiny)
    train_day(lm, [doc("A short news story about the harvest. " * 4)], Learner(lr=1e-3, train_block=16), 0, 0)
    weights = Weights(tmp_path / "w")
    weights.save("2022-06-01", lm.model, {"step": 1})
    (tmp_path / "w" / ".tmp-1234-2022-06-02").mkdir()
    assert weights.days() == ["2022-06-01"] and weights.latest() == "2022-06-01"
    assert weights.latest(before="2022-06-01") is None and weights.meta("2022-06-01") == {"step": 1}
    assert weights.as_of("2022-06-03") == "2022-06-01" and weights.as_of("2022-05-31") is None
    back = trained_copy(tiny)
    load_day(back, weights, "2022-06-01", tiny)
    for (name, a), b in zip(lm.model.state_dict().items(), back.model.state_dict().values()):
        assert torch.equal(a, b), name
    tied = back.model.get_output_embeddings().weight is back.model.get_input_embeddings().weight
    assert tied == bool(tiny.model.config.tie_word_embeddings)  # a tie (SmolLM2's) survives the file
    load_day(back, weights, None, tiny)
    assert all(torch.equal(a, b) for a, b in zip(tiny.model.state_dict().values(), back.model.state_dict().values()))


def _ppl(model, tokenizer, docs: list[Document]) -> float:
    """Reference: plain HF forward over each whole document, numpy log-softmax."""
    nll, n = 0.0, 0
    for d in docs:
        ids = tokenizer(d.text)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double().numpy()
        logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
        nll -= logp[np.arange(len(ids) - 1), ids[1:]].sum()
        n += len(ids) - 1
    return math.exp(nll / n)


@pytest.mark.slow
def test_a_parametric_stream_trains_each_day_once_and_is_evaluated_with_its_weights(prefect, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flows.compare import compare_policies
    from monim.core.config import EvalConfig
    from monim.data.feed import open_feed
    from monim.data.stream import iter_days
    from monim.run import recorded_days
    from tracking.runs import experiment_name, fetch_runs
    from tracking.store import tracking_uri

    model = str(tiny_model_dir("llama"))
    text = tmp_path / "general.txt"
    text.write_text("The river flows through the old town and into the sea near the harbour. " * 200)
    run = RunConfig(source=str(DEMO_STREAM), workdir=str(tmp_path / "work"), model=model, max_docs=2,
                    train_tokens=64, train_block=32, lr=1e-3, review=str(text), review_from=2000)
    days = ("1987-03-02", "1987-03-03")
    quiz = tmp_path / "quiz.jsonl"
    quiz.write_text("\n".join(json.dumps({"id": f"q{i}", "date": "1987-03-04", "question": q, "choices": c, "answer": [0],
                                          "source": ""}) for i, (q, c) in enumerate([
        ("Which currency did the Bank of Japan support?", ["the dollar", "the peso", "the rand", "the krona"]),
        ("What did oil prices do?", ["rose", "vanished", "sang", "froze"])])))
    evaluation = EvalConfig(period="week", text=str(text), text_chars=2000, qa=str(quiz))
    summary = compare_policies(run, *days, ["bare", "finetune", "mix-review", "recadam"], evaluation=evaluation)
    for name in ("finetune", "mix-review", "recadam"):
        weights = Weights(tmp_path / "work" / "weights" / name)
        assert weights.days() == list(days) and weights.meta(days[1])["from"] == days[0]
        assert summary[name]["tokens_seen"] == 2 * 64 and summary[name]["days"] == 2
    assert Weights(tmp_path / "work" / "weights" / "mix-review").meta(days[0])["review_tokens"] == 64
    # without a memory, the frozen LM ran over the test articles alone
    assert sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "work" / "features").glob("*/*")) == [
        "1987-03-02-test", "1987-03-03-test", "text-general.txt"]
    # each day's test PPL is the day's weights', computed here independently
    tok = AutoTokenizer.from_pretrained(model)
    ref = AutoModelForCausalLM.from_pretrained(model).eval()
    ref.load_state_dict(Weights(tmp_path / "work" / "weights" / "finetune").load(days[1]), strict=False)
    test = list(iter_days(open_feed(DEMO_STREAM), dt.date(1987, 3, 3), dt.date(1987, 3, 3)))[0].test
    rows = recorded_days(RunConfig.model_validate(run.model_dump() | {"policy": "finetune"}))
    assert rows[days[1]]["ppl"] == pytest.approx(_ppl(ref, tok, test), rel=2e-3)
    assert rows[days[1]]["ppl_lm"] == pytest.approx(_ppl(AutoModelForCausalLM.from_pretrained(model).eval(), tok, test), rel=2e-3)
    # a re-run trains nothing again: the committed weights stay byte for byte
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "work" / "weights").rglob("*.safetensors")}
    compare_policies(run, *days, ["finetune"])
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "work" / "weights").rglob("*.safetensors")} == before
    # the suite measured them like any run, and the report has their rows and cost columns
    runs = fetch_runs(tracking_uri(str(tmp_path / "work")), experiment_name(str(DEMO_STREAM)))
    assert {"ppl_text", "ppl_period/1987-W10", "qa_accuracy_0shot"} <= set(runs["recadam"]["metrics"])
    assert runs["finetune"]["metrics"]["qa_n"][-1][1] == 2
    report = (tmp_path / "work" / "report" / "report.md").read_text()
    assert "| finetune | 2 | – | – |" in report and "learning s/day" in report
