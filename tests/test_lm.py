"""Key capture, windowed scoring and LM statistics on tiny random models (independent references)."""

import datetime as dt

import numpy as np
import pytest
import torch

from monim.core.config import ScoreConfig
from monim.data.feed import Document
from monim.lm.model import last_mlp, load_lm
from monim.lm.scoring import score, score_tokens
from monim.lm.token_scores import Found
from monim.lm.windows import windows

TEXT = (
    "The central bank raised its benchmark rate by half a point on Tuesday, the largest increase in "
    "two decades, and signalled that more hikes would follow as inflation ran at a forty-year high. "
    "Markets fell sharply after the announcement, with technology shares leading the decline."
)
DOC = Document("d1", dt.date(2022, 6, 1), TEXT)
NORM_BEFORE_MLP = {"gpt2": "ln_2", "llama": "post_attention_layernorm", "gpt_neox": "post_attention_layernorm"}


def collect(lm, docs, cfg):
    """Every scored token, in document order then position (batches need not follow either)."""
    batches = list(score(lm, docs, cfg))
    out = {f: np.concatenate([getattr(b, f) for b in batches]) for f in ("doc_id", "position", "target", "logp", "max_logp", "entropy", "key")}
    rank = {d.id: i for i, d in enumerate(docs)}
    order = np.lexsort((out["position"], [rank[d] for d in out["doc_id"]]))
    return {f: v[order] for f, v in out.items()}


def full_pass(lm, text):
    """Reference: one full-context forward through the whole model, all logits in float64."""
    ids = torch.tensor([lm.tokenizer(text)["input_ids"]])
    with torch.no_grad():
        logits = lm.model(ids).logits[0, :-1].double()
    return ids[0, 1:].numpy(), torch.log_softmax(logits, -1).numpy()


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt_neox"])
def test_key_is_input_of_last_mlp(arch, tiny_model_dir):
    lm = load_lm(str(tiny_model_dir(arch)))
    block = last_mlp(lm.model)
    norm_out = {}
    parent = lm.model.get_submodule({"gpt2": "transformer.h", "llama": "model.layers", "gpt_neox": "gpt_neox.layers"}[arch])[-1]
    getattr(parent, NORM_BEFORE_MLP[arch]).register_forward_hook(lambda m, a, out: norm_out.__setitem__("v", out))
    assert block is parent.mlp
    ids = torch.tensor([lm.tokenizer(TEXT)["input_ids"][:40]])
    with torch.no_grad():
        _, keys = lm.forward(ids, torch.ones_like(ids))
    torch.testing.assert_close(keys, norm_out["v"], rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_window_stitching_equals_full_pass(arch, tiny_model_dir):
    """With context >= text length every window sees its whole prefix: equal to one full pass."""
    lm = load_lm(str(tiny_model_dir(arch)))
    targets, ref = full_pass(lm, TEXT)
    got = collect(lm, [DOC], ScoreConfig(stride=7, context=200, batch_size=3, head_chunk=5))
    assert np.array_equal(got["position"], np.arange(1, len(targets) + 1))
    assert np.array_equal(got["target"], targets)
    np.testing.assert_allclose(got["logp"], ref[np.arange(len(targets)), targets], atol=2e-5)
    np.testing.assert_allclose(got["max_logp"], ref.max(-1), atol=2e-5)
    entropy = -(np.exp(ref) * ref).sum(-1)
    np.testing.assert_allclose(got["entropy"], entropy, atol=2e-4)


def test_truncated_context_matches_per_window_reference(tiny_model_dir):
    """With a short context each target is scored from exactly `context` + its chunk's tokens."""
    lm = load_lm(str(tiny_model_dir("llama")))
    cfg = ScoreConfig(stride=5, context=6, batch_size=4, context_mode="recompute")
    ids = lm.tokenizer(TEXT)["input_ids"]
    got = collect(lm, [DOC], cfg)
    expected = []
    for p in range(1, len(ids)):
        s = 1 + (p - 1) // cfg.stride * cfg.stride  # first target of p's chunk
        a = max(0, s - 1 - cfg.context)
        with torch.no_grad():
            logits = lm.model(torch.tensor([ids[a:p]])).logits[0, -1].double()
        expected.append(torch.log_softmax(logits, -1)[ids[p]].item())
    np.testing.assert_allclose(got["logp"], expected, atol=2e-5)


def test_windows_cover_every_target_once():
    cfg = ScoreConfig(stride=4, context=3)
    spans = list(windows(12, cfg))
    assert spans == [(0, 1, 5), (1, 5, 9), (5, 9, 12)]
    assert [p for _, s, e in spans for p in range(s, e)] == list(range(1, 12))


def test_batches_mix_documents_and_keep_provenance(tiny_model_dir):
    lm = load_lm(str(tiny_model_dir("gpt2")))
    docs = [DOC, Document("d2", dt.date(2022, 6, 1), "Short second story."), Document("d3", dt.date(2022, 6, 1), TEXT[:90])]
    got = collect(lm, docs, ScoreConfig(stride=16, context=16, batch_size=4))
    for doc in docs:
        n = len(lm.tokenizer(doc.text)["input_ids"]) - 1
        mine = got["doc_id"] == doc.id
        assert mine.sum() == n and np.array_equal(got["position"][mine], np.arange(1, n + 1))
    assert got["key"].dtype == np.float16 and got["key"].shape == (len(got["target"]), 32)
    assert got["target"].dtype == np.int32


def test_unknown_architecture_is_named(gpt2_tokenizer_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("opt", vocab_size=50257, hidden_size=16, ffn_dim=32, num_hidden_layers=1,
                                  num_attention_heads=2, word_embed_proj_dim=16)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(gpt2_tokenizer_dir).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'opt'.*OPTForCausalLM"):
        load_lm(str(tmp_path))


def test_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_lm(str(tmp_path / "nope.gguf"))


def test_window_fits_the_models_positions(tiny_model_dir):
    """Tiny GPT-2 has 256 absolute positions: a 512+512 window is cut to 256 (context first)."""
    from monim.lm.windows import fit_window

    lm = load_lm(str(tiny_model_dir("gpt2")))
    cpu = dict(batch_size=8, head_chunk=256)  # what a CPU gets where the config leaves them open
    assert fit_window(lm, ScoreConfig(stride=512, context=512)) == ScoreConfig(stride=256, context=0, context_mode="recompute", **cpu)
    assert fit_window(lm, ScoreConfig(stride=200, context=512)) == ScoreConfig(stride=200, context=56, context_mode="recompute", **cpu)
    assert fit_window(lm, ScoreConfig(batch_size=3, head_chunk=5)).batch_size == 3  # set: kept
    long_doc = Document("long", dt.date(2022, 6, 1), TEXT * 12)
    n = len(lm.tokenizer(long_doc.text)["input_ids"])
    assert n > 600 and len(collect(lm, [long_doc], ScoreConfig())["target"]) == n - 1


def banded_pass(lm, ids, stride, context, sink):
    """Reference for carried context: one forward over the whole document in which input i sees the
    document's first `sink` inputs and the inputs from `context` before its step's start up to
    itself (a hand-built 4D mask)."""
    n = len(ids) - 1
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    allowed = (j <= i) & ((j >= i // stride * stride - context) | (j < sink))
    with torch.no_grad():
        hidden = lm.model.base_model(input_ids=torch.tensor([ids[:-1]]), attention_mask=torch.from_numpy(allowed)[None, None]).last_hidden_state
        logits = lm.model.lm_head(hidden)[0].double()
    return torch.log_softmax(logits, -1).numpy()


@pytest.mark.parametrize("stride,context,sink", [(5, 6, 4), (8, 3, 2), (8, 3, 0)])
def test_carried_context_equals_banded_single_pass(stride, context, sink, tiny_model_dir):
    """Carry: each step sees the previous step's last `context` inputs and the document's first
    `sink` through the KV cache, in lockstep batches that documents of fewer steps leave early."""
    lm = load_lm(str(tiny_model_dir("llama")))
    docs = [DOC, Document("d2", dt.date(2022, 6, 1), TEXT[:150]), Document("d3", dt.date(2022, 6, 1), TEXT[40:190]),
            Document("d4", dt.date(2022, 6, 1), "Rates rose."), Document("d5", dt.date(2022, 6, 1), TEXT[:70]),
            Document("d6", dt.date(2022, 6, 1), TEXT[90:])]
    got = collect(lm, docs, ScoreConfig(stride=stride, context=context, batch_size=3, head_chunk=7, sink=sink))
    for doc in docs:
        ids = lm.tokenizer(doc.text)["input_ids"]
        ref = banded_pass(lm, ids, stride, context, sink)
        mine = got["doc_id"] == doc.id
        assert np.array_equal(got["position"][mine], np.arange(1, len(ids)))
        np.testing.assert_allclose(got["logp"][mine], ref[np.arange(len(ids) - 1), ids[1:]], atol=2e-5)
        np.testing.assert_allclose(got["max_logp"][mine], ref.max(-1), atol=2e-5)


def test_document_context_equals_full_pass_and_packs_short_documents(tiny_model_dir):
    """Document context: every token sees its whole document, in long steps and in packed rows alike."""
    lm = load_lm(str(tiny_model_dir("llama")))
    docs = [DOC, Document("d2", dt.date(2022, 6, 1), "Short second story."), Document("d3", dt.date(2022, 6, 1), TEXT[:90])]
    got = collect(lm, docs, ScoreConfig(stride=16, context=4, batch_size=3, context_mode="document"))
    for doc in docs:
        targets, ref = full_pass(lm, doc.text)
        mine = got["doc_id"] == doc.id
        assert np.array_equal(got["target"][mine], targets)
        np.testing.assert_allclose(got["logp"][mine], ref[np.arange(len(targets)), targets], atol=2e-5)
        np.testing.assert_allclose(got["entropy"][mine], -(np.exp(ref) * ref).sum(-1), atol=2e-4)


def test_statistics_read_once_a_pass_equal_those_read_per_chunk_and_the_passes_are_the_plans(tiny_model_dir):
    """Without a memory to search, a pass's statistics are read from the device once, after the next
    pass is queued: they equal the per-chunk path's (with a search hook), and the passes are the
    plan's: one-step documents packed `batch_size` rows a pass, longer ones stepped in lockstep."""
    lm = load_lm(str(tiny_model_dir("llama")))
    rng = np.random.default_rng(0)
    seqs = [(f"s{i}", rng.integers(1, 500, n).tolist(), 1) for i, n in enumerate([9] * 7 + [30, 25, 14])]
    cfg = ScoreConfig(stride=8, context=8, batch_size=4, head_chunk=5)
    passes, forward = [0], lm.forward
    lm.forward = lambda *a, **k: (passes.__setitem__(0, passes[0] + 1), forward(*a, **k))[1]
    plain = list(score_tokens(lm, seqs, cfg))
    # 7 one-step documents (9 tokens: 8 inputs) fill 7 rows of 8, 4 a pass: 2 passes; the 3 longer ones
    # step together, leaving as they end: ceil(29/8) = 4 steps
    assert passes[0] == 2 + 4 and len(plain) == passes[0]

    def empty(b):
        return Found(np.full((len(b), 1), np.inf, np.float32), np.full((len(b), 1), -1, np.int32),
                     np.full((len(b), 1), -1, np.int64))

    searched = list(score_tokens(lm, seqs, cfg, empty))
    for f in ("doc_id", "position", "prev", "target", "logp", "max_logp", "entropy", "argmax", "key"):
        a, b = (np.concatenate([getattr(x, f) for x in part]) for part in (plain, searched))
        assert np.array_equal(a, b), f
    assert sum(len(b) for b in plain) == sum(n - 1 for _, toks, _ in seqs for n in [len(toks)])
