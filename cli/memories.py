"""The memory a reading command reads, and Θ opened from it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from cli.errors import clear_errors, fail, option_date

if TYPE_CHECKING:
    from monim.theta.memory import Memory


def memory_dir(workdir: Path, policy: Optional[str]) -> Path:
    """The memory a reading command reads: the one named, the only one, else MoNIM-AMT's."""
    from monim.storage.workdirs import memories

    found = memories(workdir)
    if not found:
        raise fail(f"no memory in {workdir} (run `monim learn` first)")
    if policy:
        match = [p for p in found if p.name == policy]
        if not match:
            raise fail(f"no {policy!r} memory in {workdir}; there are: {', '.join(p.name for p in found)}")
        return match[0]
    return found[0] if len(found) == 1 else next((p for p in found if p.name == "monim-amt"), found[0])


def open_memory(workdir: Path, policy: Optional[str], as_of: Optional[str], **overrides) -> Memory:
    """Θ as the chosen memory describes itself (monim.theta.memory.Memory.open), with a reader's overrides; what
    is refused (no such memory, no day by --as-of, an override that changes what was learned) is refused from its
    manifest, before torch and the LM."""
    from monim.core.manifest import ManifestError, MemoryMismatch, recorded
    from monim.storage.datastore import Datastore
    from monim.storage.memory_settings import Settings, SettingsMismatch

    root, overrides = memory_dir(workdir, policy), {k: v for k, v in overrides.items() if v is not None}
    day = option_date(as_of)
    with clear_errors(ManifestError, SettingsMismatch, ValueError):
        ds = Datastore.read(root)
        Settings.from_dict(recorded(ds.manifest)).read_with(**overrides)
    first = ds.days[0].date if ds.days else None
    if day is not None and (first is None or day.isoformat() < first):
        raise fail(f"--as-of {as_of}: {root} holds no day on or before it (its first day is {first or 'not learned yet'})")
    from monim.theta.memory import Memory

    with clear_errors(ManifestError, MemoryMismatch, SettingsMismatch, ValueError):
        return Memory.open(root, as_of=day, **overrides)
