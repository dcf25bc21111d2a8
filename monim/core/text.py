"""What makes text unsafe to read, wherever it comes from (a feed's line, an HTTP body): JSON nested
deeper than a reader allows (Python's json recurses once a level, and stops where the caller's stack
ends) and a lone surrogate (a `\\ud800` escape makes one: no character, no UTF-8, no token)."""

from __future__ import annotations

import re

import numpy as np

STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string, escapes included
NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


def json_depth(text: str) -> int:
    """How deep a JSON text nests arrays and objects (brackets inside strings not counted), before parsing it."""
    brackets = np.frombuffer(NOT_BRACKETS.sub("", STRING.sub("", text)).encode(), np.uint8)
    opens = (brackets == ord("[")) | (brackets == ord("{"))
    return int(np.cumsum(np.where(opens, 1, -1), dtype=np.int64).max(initial=0))


def lone_surrogate(value: str) -> int | None:
    """Where a string's first lone surrogate is (its index), or None: a string UTF-8 can write."""
    try:
        value.encode()
    except UnicodeEncodeError as e:
        return e.start
    return None
