"""Inputs on the LM's device without host round trips: host arrays uploaded without waiting for the
device, and attention masks built by monim (transformers' own preparation tests a 2-D mask, or the
positions for packed sequences, in Python each pass: a read of the device that leaves it idle)."""

from __future__ import annotations

import numpy as np
import torch

from monim.lm.model import LM


def upload(x: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device, queued (on a GPU through pinned memory: the host does not wait for the device's work)."""
    t = torch.from_numpy(np.ascontiguousarray(x))
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def own_masks(lm: LM) -> bool:
    """Whether monim builds the model's attention masks itself (`attention_mask`): plain full-attention layers
    under sdpa or eager attention (else transformers builds them, testing a 2-D mask or the positions
    for packed sequences in Python each pass: a read of the device)."""
    return lm.model.config._attn_implementation in ("sdpa", "eager") and lm.stepwise


def attention_mask(lm: LM, held: torch.Tensor, q: int, segment: torch.Tensor | None = None) -> torch.Tensor:
    """The attention mask [rows, 1, q, columns] of a pass whose q new tokens are each row's last columns
    (`own_masks`): a token sees the columns `held` [rows, columns] (its row's tokens, not padding) up
    to itself and, given `segment` [rows, q] (a packed row's spans), only its own span's."""
    columns = held.shape[1]
    i = torch.arange(columns - q, columns, device=held.device)[:, None]
    j = torch.arange(columns, device=held.device)[None, :]
    allowed = held[:, None, :] & (j <= i)
    if segment is not None:
        allowed &= segment[:, :, None] == segment[:, None, :]
    allowed |= j == i  # a padding token sees itself: no row of the mask is empty (its outputs are dropped)
    if lm.model.config._attn_implementation == "sdpa":
        return allowed[:, None]
    return torch.zeros(allowed[:, None].shape, dtype=lm.model.dtype, device=held.device).masked_fill_(
        ~allowed[:, None], torch.finfo(lm.model.dtype).min)
