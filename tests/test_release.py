"""What a release promises: the changelog's latest version is the one `monim --version` prints, the
stability page lists exactly the Python names `monim` exports (each of which imports), a memory of a
newer format is refused as the upgrade notes say, and `monim serve-model` names a port in use."""

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MONIM = str(Path(sys.executable).parent / "monim")


def test_the_changelog_starts_with_the_version_monim_prints():
    latest = re.search(r"^## (\d+\.\d+\.\d+) ", (REPO / "docs" / "changelog.md").read_text(), re.M)[1]
    printed = subprocess.run([MONIM, "--version"], capture_output=True, text=True, check=True).stdout.split()
    assert printed == ["monim", latest]


def test_the_stability_page_lists_exactly_the_names_monim_exports():
    import importlib

    import monim

    page = (REPO / "docs" / "reference" / "stability.md").read_text()
    table = page.split("## The Python names")[1].split("\n## ")[0]
    listed = re.findall(r"^\| `(\w+)` \| .* \| `([\w.]+)` \|$", table, re.M)
    assert sorted(name for name, _ in listed) == sorted(monim.__all__)
    for name, home in listed:
        assert getattr(monim, name) is getattr(importlib.import_module(home), name)
    namespace: dict = {}
    exec("from monim import *", namespace)
    assert set(monim.__all__) <= set(namespace)
    with pytest.raises(AttributeError):
        monim.no_such_name


def test_a_memory_of_a_newer_format_is_refused_and_an_older_one_read(random_datastore):
    from monim.core.manifest import FORMAT, ManifestError
    from monim.storage.datastore import Datastore

    root = random_datastore((5,)).root
    path = root / "manifest.json"
    manifest = json.loads(path.read_text())
    assert manifest["format"] == FORMAT
    path.write_text(json.dumps(manifest | {"format": FORMAT + 1}))
    with pytest.raises(ManifestError, match=rf"manifest.json: field 'format': {FORMAT + 1}: written by a newer monim"):
        Datastore.read(root)
    path.write_text(json.dumps({k: v for k, v in manifest.items() if k != "format"}))  # before the field
    assert len(Datastore.read(root)) == 5


def test_serve_model_names_a_port_in_use_before_it_loads_anything(tmp_path):
    (tmp_path / "memories" / "monim-amt").mkdir(parents=True)
    (tmp_path / "memories" / "monim-amt" / "manifest.json").write_text('{"days": []}')
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run([MONIM, "serve-model", "--workdir", str(tmp_path), "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == (f"error: --port {port}: something already listens on port {port} (another "
                                   "`monim serve-model`?): stop it, or serve on another port (--port N)")
