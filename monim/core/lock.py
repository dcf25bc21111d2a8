"""One writer at a time: an exclusive lock per memory (and per work directory, for its runs' rows).

The lock is an advisory `flock` on a file, through `filelock`: the kernel drops it when its holder
dies, even by `kill -9`, so a dead holder's lock is simply free. Beside it, `<lock>.holder`
says who holds it (pid, host, command, since when) for the message a waiting writer prints.
On a network filesystem, Linux implements flock with the server's byte-range locks (NFSv4, or
NLM for v3): the lock holds across hosts when the mount supports locking; where it does not
(`nolock`), filelock falls back to a marker file whose holder is checked by pid and host.
Readers take no lock: they read the manifest, which a writer replaces in one rename. A check that
must not meet a writer's half-finished day (fsck) waits with `reading`: a shared flock on the lock
file opened read-only, which writes nothing (it runs on a full disk or a read-only mount).
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock, Timeout

from monim.core.atomic import write_json


class Locked(RuntimeError):
    """Another writer holds the lock (raised instead of waiting, when asked not to wait)."""


def holder(lock: Path) -> str:
    """Who holds (or last held) the lock, in words."""
    try:
        h = json.loads(Path(f"{lock}.holder").read_text())
    except (OSError, ValueError):
        return "another process"
    return f"pid {h['pid']} on {h['host']} since {h['since']} ({h['command']})"


@contextmanager
def hold(path: Path | str, wait: bool = True, say: Callable[[str], None] | None = None,
         every: float = 30.0) -> Iterator[None]:
    """Hold the exclusive lock at `path` for this process (re-entrant: a flow and its tasks may
    nest). Waiting, `say` is told who holds it, then again every `every` seconds; with
    wait=False a held lock raises Locked at once."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path, thread_local=False, is_singleton=True)  # one per path: tasks run in other threads
    first = not lock.is_locked
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if not wait:
            raise Locked(f"{path.parent} is being written by {holder(path)}; not waiting (--no-wait)") from None
        while True:
            (say or print)(f"waiting for {path.parent}: it is being written by {holder(path)}")
            try:
                lock.acquire(timeout=every)
                break
            except Timeout:
                continue
    try:
        if first:
            write_json(Path(f"{path}.holder"), {
                "pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)[:300],
                "since": dt.datetime.now().astimezone().isoformat(timespec="seconds")})
        yield
    finally:
        lock.release()


@contextmanager
def reading(path: Path | str, say: Callable[[str], None] | None = None) -> Iterator[None]:
    """Wait until no writer holds the lock at `path` (`say` is told who does), and keep writers out while
    the block reads: a shared flock on the lock file opened read-only, so nothing is written. No lock
    file: no writer ever held it; this process holding it (`hold`): it reads what it writes."""
    if FileLock(path, thread_local=False, is_singleton=True).is_locked:
        yield
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            (say or print)(f"waiting for {Path(path).parent}: it is being written by {holder(Path(path))}")
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)
