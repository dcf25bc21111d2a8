"""Atomic writes: a file or a folder appears complete or not at all. It is written aside (under a
`.tmp-` name), flushed to disk, renamed into place, and the rename flushed. A crash leaves at most a
`.tmp-` stray, which readers ignore and `monim fsck --repair` removes."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

TMP = ".tmp-"


class DiskFull(OSError):
    """The disk filled up while writing; what was there before is unchanged."""


def is_stray(path: Path) -> bool:
    """A file or folder left by an interrupted atomic write."""
    return path.name.startswith(TMP)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
        else:
            fsync_dir(p)


def _aside(path: Path) -> Path:
    """A fresh `.tmp-` name beside `path`, in its folder (made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(f"{TMP}{uuid.uuid4().hex[:8]}-{path.name}")


@contextmanager
def replacing(path: Path | str) -> Iterator[Path]:
    """A temporary path beside `path` (same suffix) to write a file or folder to; when the block
    ends without error it is flushed and renamed to `path`, else removed (ENOSPC raises DiskFull)."""
    path = Path(path)
    tmp = _aside(path)
    try:
        yield tmp
        _fsync_tree(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DiskFull(errno.ENOSPC, f"disk full while writing {path}; what was there before is unchanged") from e
        raise
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def create_once(path: Path, make: Callable[[Path], None]) -> None:
    """If `path` does not exist, `make` it aside and link it into place whole; if another process
    made it meanwhile, theirs stays (a rename would replace what it may already have written)."""
    if path.exists():
        return
    tmp = _aside(path)
    try:
        make(tmp)
        _fsync_tree(tmp)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path | str, obj, indent: int | None = 1) -> None:
    with replacing(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=indent))


def sqlite_damage(path: Path) -> str | None:
    """What is wrong with an SQLite database file (a quick check, read-only), or None where it reads well."""
    import sqlite3

    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            found = db.execute("PRAGMA quick_check").fetchone()[0]
    except sqlite3.DatabaseError as e:
        return str(e)
    return None if found == "ok" else found


def checksum(path: Path) -> str:
    """sha256 of a file's bytes (written at commit, checked by fsck)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
