"""Reads of device results by the host: `to_host` and `queued` are the ways results leave the device,
and `reads()` counts every read made inside it, the hidden ones too (an `.item()`, a `bool(tensor)`,
a boolean mask's indexing: each waits for the device on a GPU), so a test on the CPU proves a path's
plan of reads and fails when one is added."""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator, overload

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# torch.Tensor's methods that read a tensor on the host (under inference_mode `.item()` reaches no
# dispatch mode: they are counted themselves, while open)
READERS = ("numpy", "cpu", "tolist", "item", "__bool__", "__int__", "__float__", "__index__")
_methods = {name: getattr(torch.Tensor, name) for name in READERS}
# operators that wait for the device: a number read, or an output whose size depends on the values
SYNCS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
         "equal", "is_nonzero", "bincount"}
_counters: list[Counter] = []  # the open `reads()` counters, innermost last
_lock = threading.Lock()
_inside = threading.local()  # a counted read's own operators are not counted again


def _count(what: str) -> None:
    if getattr(_inside, "depth", 0):
        return
    with _lock:
        for counter in _counters:
            counter[what] += 1


@contextmanager
def planned() -> Iterator[None]:
    """A planned read: allowed while torch.cuda's sync debug mode stops the others (benchmarks/gpu.py)."""
    mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_initialized() else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


def _copy(t: torch.Tensor, wait: bool) -> torch.Tensor:
    """A host copy of t (`wait=False` on a GPU: queued into pinned memory, not yet safe to read)."""
    if t.device.type == "cpu":
        return t.detach()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=not wait)
    with planned() if wait else nullcontext():
        return out.copy_(t, non_blocking=not wait)


@overload
def to_host(t: torch.Tensor) -> np.ndarray: ...
@overload
def to_host(t: dict[str, torch.Tensor]) -> dict[str, np.ndarray]: ...
def to_host(t: torch.Tensor | dict[str, torch.Tensor]) -> np.ndarray | dict[str, np.ndarray]:
    """A device tensor (or a dict of them: copied in one go) as host arrays: one read."""
    _count("to_host")
    if isinstance(t, dict):
        return {f: _methods["numpy"](_copy(v, True)) for f, v in t.items()}
    return _methods["numpy"](_copy(t, True))


def queued(tensors: dict[str, torch.Tensor]) -> Callable[[], dict[str, np.ndarray]]:
    """Tensors' copies to the host queued behind the device's work now, without waiting; calling the
    result waits for them once (one read) and gives them as host arrays."""
    copies = {f: _copy(t, False) for f, t in tensors.items()}
    done, cuda = None, [t.device for t in tensors.values() if t.device.type == "cuda"]
    if cuda:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(cuda[0]))  # the stream the copies were queued on

    def read() -> dict[str, np.ndarray]:
        _count("to_host")
        if done is not None:
            done.synchronize()
        return {f: _methods["numpy"](t) for f, t in copies.items()}

    return read


class _Syncs(TorchDispatchMode):
    """Counts the operators that wait for the device (SYNCS, and indexing by a boolean mask)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in SYNCS or (name in ("index", "index_put", "index_put_") and _bool_index(args)):
            _count(name)
        return func(*args, **(kwargs or {}))


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def _counted(name: str) -> Callable:
    method = _methods[name]

    def read(self, *args, **kwargs):
        _count(name)
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            _inside.depth -= 1

    return read


@contextmanager
def reads() -> Iterator[Counter]:
    """Count the host reads made inside (`to_host`, `queued` reads, torch.Tensor's READERS; in this
    thread, the operators that wait for the device, SYNCS and boolean-mask indexing), by kind; `sum(counter.values())` is the total. For
    tests: it slows every operator and patches torch.Tensor's reading methods while open."""
    counter: Counter = Counter()
    with _lock:
        _counters.append(counter)
        if len(_counters) == 1:
            for name in READERS:
                setattr(torch.Tensor, name, _counted(name))
    try:
        with _Syncs():
            yield counter
    finally:
        with _lock:
            del _counters[next(i for i, c in enumerate(_counters) if c is counter)]
            if not _counters:
                for name in READERS:
                    setattr(torch.Tensor, name, _methods[name])
