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


NO_ROOM = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
           errno.EFBIG: "the file-size limit is reached (ulimit -f)"}
SQLITE_FULL = "database or disk is full"  # SQLite's words for ENOSPC and EFBIG


class DiskFull(OSError):
    """The disk filled up (or a file reached the file-size limit) while writing `path`; what was there
    before is unchanged."""

    def __init__(self, code: int, path: Path | str):
        super().__init__(code, f"{NO_ROOM[code]} while writing {path}; what was there before is unchanged")
        self.path = str(path)


def no_room(error: BaseException | None) -> tuple[str, str] | None:
    """Whether an error, or one it came from, is a full disk or a file-size limit: (what happened, the
    file being written, '' where the error does not say); None where it is not."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno is not None and error.errno in NO_ROOM:
            return NO_ROOM[error.errno], error.path if isinstance(error, DiskFull) else error.filename or ""
        if SQLITE_FULL in str(error):
            return SQLITE_FULL, ""
        error = error.__cause__ or error.__context__
    return None


def out_of_room(path: Path, margin: int = 1 << 20) -> str | None:
    """Why a file at `path` cannot grow, where it cannot: its size within `margin` bytes of the process's
    file-size limit, or less than `margin` free on its disk (an SQLite database grows by pages, its
    journal beside it); None where there is room."""
    import resource

    limit, size = resource.getrlimit(resource.RLIMIT_FSIZE)[0], path.stat().st_size if path.exists() else 0
    if limit != resource.RLIM_INFINITY and size + margin > limit:
        return f"{NO_ROOM[errno.EFBIG]} while writing {path} ({size} bytes, the limit {limit})"
    if path.parent.exists() and shutil.disk_usage(path.parent).free < margin:
        return f"{NO_ROOM[errno.ENOSPC]} while writing {path} ({shutil.disk_usage(path.parent).free} bytes free)"
    return None


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
    ends without error it is flushed and renamed to `path`, else removed (a full disk or a file-size
    limit raises DiskFull)."""
    path = Path(path)
    tmp = _aside(path)
    try:
        yield tmp
        _fsync_tree(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        if e.errno in NO_ROOM:
            raise DiskFull(e.errno, path) from e
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
        if "readonly" in str(e) and Path(f"{path}-journal").exists():
            return None  # the journal of a write that failed (a full disk): rolled back by the next open that may write
        return str(e)
    return None if found == "ok" else found


def checksum(path: Path) -> str:
    """sha256 of a file's bytes (written at commit, checked by fsck)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
