"""A day's passes without host round trips: inputs, provenance and attention masks built by monim, each
pass read once (monim.lm.host counts the reads, hidden ones too), its scores those of transformers' masks."""

import numpy as np
import pytest

from monim.core.config import ScoreConfig
from monim.lm import scoring
from monim.lm.host import reads
from monim.lm.model import load_lm

FIELDS = ("doc_id", "position", "prev", "target", "logp", "max_logp", "entropy", "argmax", "key")


def scored(lm, seqs, cfg):
    """Every pass's scores, the passes run and the host reads made."""
    passes, forward = [0], lm.forward
    lm.forward = lambda *a, **k: (passes.__setitem__(0, passes[0] + 1), forward(*a, **k))[1]
    try:
        with reads() as counted:
            batches = list(scoring.score_tokens(lm, seqs, cfg))
    finally:
        del lm.forward
    return {f: np.concatenate([getattr(b, f) for b in batches]) for f in FIELDS}, passes[0], counted


@pytest.mark.parametrize("arch,attention", [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa"), ("gpt_neox", "sdpa")])
@pytest.mark.parametrize("mode", ["carry", "document", "recompute"])
def test_a_pass_reads_once_and_scores_as_transformers_masks_do(arch, attention, mode, tiny_model_dir, monkeypatch):
    """Sequences packed several to a row and stepped in lockstep (padded, leaving early): each pass is
    read from the device once and nothing else is read (no mask tested in Python), and every token's
    statistics and key equal those computed under the masks transformers builds from 2-D inputs
    (sdpa's boolean masks and eager attention's additive ones alike)."""
    lm = load_lm(str(tiny_model_dir(arch)))
    lm.model.set_attn_implementation(attention)
    rng = np.random.default_rng(1)
    seqs = [(f"s{i}", rng.integers(1, 500, n).tolist(), 1) for i, n in enumerate([9, 5, 7, 3, 9, 6, 30, 25, 14, 23])]
    cfg = ScoreConfig(stride=8, context=8, batch_size=3, head_chunk=5, sink=2, context_mode=mode)
    mine, passes, counted = scored(lm, seqs, cfg)
    assert passes > 2 and counted == {"to_host": passes}
    monkeypatch.setattr(scoring, "own_masks", lambda lm: False)
    theirs, their_passes, their_reads = scored(lm, seqs, cfg)
    assert their_passes == passes
    if arch == "llama":  # the counter sees the reads transformers' mask preparation makes
        assert sum(their_reads.values()) > passes
    for f in ("doc_id", "position", "prev", "target", "argmax"):
        assert np.array_equal(mine[f], theirs[f]), f
    for f in ("logp", "max_logp", "entropy"):
        np.testing.assert_allclose(mine[f], theirs[f], atol=1e-4, err_msg=f)
    np.testing.assert_allclose(mine["key"].astype(np.float32), theirs["key"].astype(np.float32), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_a_pass_without_padding_keeps_no_keys_and_values_and_scores_as_transformers_masks_do(arch, tiny_model_dir, monkeypatch):
    """Rows of one whole span each (no padding: plain causal attention) run with a KV cache that keeps
    nothing, read once a pass, their scores those of transformers' own masks."""
    lm = load_lm(str(tiny_model_dir(arch)))
    rng = np.random.default_rng(2)
    seqs = [(f"s{i}", rng.integers(1, 500, 17).tolist(), 1) for i in range(7)]
    cfg = ScoreConfig(stride=16, context=0, batch_size=3, head_chunk=5, context_mode="document")
    caches, forward = [], lm.forward
    lm.forward = lambda *a, **k: (caches.append(a[3]), forward(*a, **k))[1]  # `scored` lets it go
    mine, passes, counted = scored(lm, seqs, cfg)
    assert passes == 3 and counted == {"to_host": passes}
    assert caches == [lm.passing] * passes and all(layer.keys is None for layer in lm.passing.layers)  # nothing kept
    monkeypatch.setattr(scoring, "own_masks", lambda lm: False)
    theirs, _, _ = scored(lm, seqs, cfg)
    for f in ("doc_id", "position", "prev", "target", "argmax"):
        assert np.array_equal(mine[f], theirs[f]), f
    for f in ("logp", "max_logp", "entropy"):
        np.testing.assert_allclose(mine[f], theirs[f], rtol=0, atol=1e-5, err_msg=f)
    np.testing.assert_allclose(mine["key"].astype(np.float32), theirs["key"].astype(np.float32), atol=2e-3, rtol=2e-3)
