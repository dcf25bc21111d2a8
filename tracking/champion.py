"""Where `champion` points and how it moves: to a new day's version where its validation PPL is not worse
than the champion's on the same validation articles (settle, the gate's last step: tasks.gate), by hand
(promote, rollback), or off a version that can no longer load once a memory's state is registered again
(register_state, after a forget); `previous` keeps the one it replaced. Each move is a Prefect event.
Each function takes the tracking URI first."""

from __future__ import annotations

from pathlib import Path

from monim.storage.datastore import Datastore
from tracking.store import client, one_at_a_time
from tracking.versions import CHAMPION, PREVIOUS, aliased, find_version, model_versions, new_version, registered

CHAMPION_MOVED = "monim.champion.moved"  # the Prefect event each move of `champion` emits


def _point(uri: str, name: str, version: str, reason: str) -> None:
    """Point `champion` at a version and say so: a Prefect event, `monim.champion.moved` (resource
    `monim.model.<name>`; payload model, version, day, reason), that automations can trigger on
    where a Prefect API is configured (a daily deployment's server; a command's own API has no listener)."""
    c = client(uri)
    c.set_registered_model_alias(name, CHAMPION, str(version))
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        from prefect.events import emit_event

        day = c.get_model_version(name, str(version)).tags.get("monim.as_of")
        emit_event(CHAMPION_MOVED, resource={"prefect.resource.id": f"monim.model.{name}", "prefect.resource.name": name},
                   payload={"model": name, "version": str(version), "day": day, "reason": reason})


def _move(uri: str, name: str, version: str, reason: str) -> dict:
    """Point `champion` at a version (`reason`: new day, promote), and `previous` at the champion it replaces."""
    old = aliased(uri, name, CHAMPION)
    was = None if old is None else str(old.version)  # (this MLflow returns it as an int)
    if was is not None and was != str(version):
        client(uri).set_registered_model_alias(name, PREVIOUS, was)
    _point(uri, name, version, reason)
    kept = aliased(uri, name, PREVIOUS)
    return {"champion": str(version), "previous": None if kept is None else str(kept.version)}


@one_at_a_time
def settle(uri: str, name: str, version: str, champion: str | None, gate: dict) -> bool:
    """Log the gate on the version and move `champion` to it if it passed, unless the champion moved
    meanwhile (the gate then compared with another version)."""
    c = client(uri)
    for key, value in gate.items():
        c.set_model_version_tag(name, version, key, str(value))
    now = aliased(uri, name, CHAMPION)
    if (None if now is None else str(now.version)) != champion:
        return False
    if champion is None or gate.get("gate_tokens") and not gate["gate_ppl"] > gate["gate_ppl_champion"]:
        _move(uri, name, version, "new day")
        return True
    return False  # worse, or nothing to compare on (a day without validation articles): the champion stays


def _changed_since(memory: Path, as_of: str, registered_as: str | None) -> str | None:
    """The checksum a memory's day has now where it differs from the one a version registered (the
    version can no longer load: a forget changed its day); None while it loads."""
    now = Datastore.read(memory).checksum(as_of)
    return None if registered_as is None or now == registered_as else now


def _loadable(name: str, version, memory: Path) -> None:
    """Refuse a version that can no longer load, naming the command that registers its day's state."""
    as_of = version.tags.get("monim.as_of")
    if _changed_since(memory, as_of, version.tags.get("monim.checksum")):
        raise ValueError(f"{name} version {version.version} (Θ as of {as_of}) can no longer load: {memory} changed "
                         f"since it was registered; `monim register --as-of {as_of}` registers the day's state")


@one_at_a_time
def promote(uri: str, memory: Path, version: str | None = None) -> dict:
    """Move `champion` by hand (default: to the newest version); `previous` keeps the one it replaces.
    A version that can no longer load is refused."""
    name = registered(uri, memory)
    versions = {str(v.version): v for v in model_versions(uri, name)}
    version = str(version or list(versions)[-1])
    if version not in versions:
        raise ValueError(f"{name} has no version {version}; it has {', '.join(versions)}")
    _loadable(name, versions[version], memory)
    return {"model": name} | _move(uri, name, version, "promote")


@one_at_a_time
def rollback(uri: str, memory: Path) -> dict:
    """Move `champion` back to `previous` (which is then cleared), unless that can no longer load."""
    name = registered(uri, memory)
    back = aliased(uri, name, PREVIOUS)
    if back is None:
        raise ValueError(f"{name} has no 'previous' version to roll back to")
    _loadable(name, back, memory)
    _point(uri, name, str(back.version), "rollback")
    client(uri).delete_registered_model_alias(name, PREVIOUS)
    return {"model": name, "champion": str(back.version), "previous": None}


def stale_champion(uri: str, memory: Path) -> dict | None:
    """The champion of a memory's model if it can no longer load (what it reads changed since it was
    registered: a forget), with the checksum its day has now; None if it loads, or there is none."""
    try:
        champion = find_version(uri, memory)
    except ValueError:  # no registered model, or no champion
        return None
    now = _changed_since(memory, champion["as_of"], champion["checksum"])
    return None if now is None else champion | {"checksum_now": now}


@one_at_a_time
def register_state(uri: str, memory: Path, as_of: str | None = None) -> dict:
    """Register a memory's current state (its last day, the day `as_of` and the champion's day) as new
    versions where that state is not registered yet. A champion that can no longer load (a forget
    changed its day) is replaced, with no gate, by its day's new version (the same day without what
    was forgotten), or by the last day's where its day was forgotten whole; `previous` is kept."""
    name, ds = registered(uri, memory), Datastore.read(memory)
    if not ds.days:
        raise ValueError(f"{memory} holds no committed day to register")
    if as_of is not None and not ds.committed(as_of):
        raise ValueError(f"{memory} has no committed day {as_of}; its days: {ds.days[0].date} to {ds.days[-1].date}")
    stale, last = stale_champion(uri, memory), ds.days[-1].date
    replacing = None if stale is None else stale["as_of"] if ds.committed(stale["as_of"]) else last
    days = {as_of or last, last} | ({replacing} if replacing else set())
    newest = model_versions(uri, name)[-1]
    run_id = newest.tags.get("monim.run_id")  # the versions' artifacts go beside the newest's
    if run_id is None:
        raise ValueError(f"{name} version {newest.version} names no MLflow run (tag monim.run_id) to log beside")
    done: dict[str, dict] = {}
    for day in sorted(days):
        version, new = new_version(uri, name, memory, day, ds.checksum(day), run_id)
        done[day] = {"version": version, "new": new}
    out: dict = {"model": name, "registered": done}
    if stale and replacing:
        out |= {"champion": _replace(uri, name, stale["version"], done[replacing]["version"]), "replaced": stale["version"]}
    return out


@one_at_a_time
def _replace(uri: str, name: str, expected: str, version: str) -> str | None:
    """Point `champion` at `version` where it still points at `expected` (which can no longer load, so
    `previous` stays as it is: a rollback must not return to it); where `champion` points after."""
    now = aliased(uri, name, CHAMPION)
    if now is not None and str(now.version) == str(expected):
        _point(uri, name, version, "forget")
        return str(version)
    return None if now is None else str(now.version)
