"""A memory's files read against their commit, for the readers that answer from it: every byte once
at open (monim fsck's check of a day's shard), then a stat a look to see whether a file was written
in place since (Memory.damaged, the server's /health)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from monim.core.atomic import checksum
from monim.core.manifest import Damaged
from monim.storage.datastore import Datastore
from monim.storage.fsck import day_problem

# each shard file read: its stamp from before it was read, the commit's sha256, its day, whether its bytes matched
Verified = dict[Path, tuple[tuple[int, ...], str, str, bool]]


def verified(ds: Datastore, as_of: dt.date | str | None = None, removing: tuple[str, ...] = ()) -> Verified:
    """Refuse (Damaged, naming the file and the day) a memory whose shards as of `as_of` differ from
    their commit: every byte read once against the checksums written at commit (monim fsck's check).
    No cache is trusted, none written: a reader writes nothing, and a file's size and time say
    nothing of a copy made with its times kept. The files read, each with its stamp from before."""
    files: Verified = {}
    for day in ds.days:
        if (as_of is not None and day.date > str(as_of)) or day.date in removing:
            continue
        folder = ds.root / "shards" / day.shard
        files |= {folder / f: (_stamp(folder / f), digest, day.date, True) for f, digest in day.checksums.items()
                  if (folder / f).is_file()}
        if problem := day_problem(ds, day):
            raise Damaged.of(f"{problem.where}: {problem.what}", day.date)
    return files


def _stamp(path: Path) -> tuple[int, ...]:
    """Which file a path names and whether it was written since: its device and inode, size, and
    modification and change times (the change time is set by the kernel at any write: a copy that
    keeps the modification time does not keep it)."""
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def looked_again(files: Verified) -> str | None:
    """Why a file verified (and stamped) before now differs from its commit, or None: a stat each, the
    file read again only where it was written in place since (a file a commit replaced is another
    file, and a pinned memory maps the one it verified). Bit rot below the filesystem changes no
    stamp: `monim fsck` reads every byte."""
    for path, (stamp, digest, date, good) in files.items():
        try:
            now = _stamp(path)
        except FileNotFoundError:
            continue  # removed by a forget or gc: a pinned memory maps the file it verified
        if now[:2] != stamp[:2]:
            continue
        if now != stamp:  # read again once per write, not at every look
            good = checksum(path) == digest
            files[path] = (now, digest, date, good)
        if not good:
            return str(Damaged.of(f"{path}: written since it was verified, it differs from the commit of day {date}",
                                  date))
    return None
