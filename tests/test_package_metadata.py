"""Packaging metadata without a build: one version everywhere, package data that matches real files, a changelog
entry for the current version, the licence and the extras. `.ci/package` builds and installs the real thing."""

from __future__ import annotations

import fnmatch
import re
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest

import vitlab
from vitlab.cli import main

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the rest of the suite runs on 3.10 too

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "vitlab"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
VERSION = PROJECT["version"]


def test_version_is_one_value_everywhere(capsys):
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION), VERSION
    fix = "the installed metadata is stale; reinstall with `pip install -e .`"
    assert installed_version("vitlab") == VERSION, fix
    assert vitlab.__version__ == VERSION, fix
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"vitlab {VERSION}"


def test_changelog_has_an_entry_for_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", text, flags=re.M)
    assert releases, "CHANGELOG.md has no '## [X.Y.Z] - YYYY-MM-DD' entries (Keep a Changelog)"
    assert releases[0] == VERSION, f"the newest CHANGELOG.md entry is {releases[0]}, pyproject says {VERSION}"
    assert releases == sorted(releases, key=lambda v: tuple(map(int, v.split("."))), reverse=True)


def _package_files() -> list[str]:
    """Every non-Python file under src/vitlab, relative to it (what the wheel can only get through package-data)."""
    files = []
    for path in PACKAGE.rglob("*"):
        if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts:
            files.append(path.relative_to(PACKAGE).as_posix())
    return sorted(files)


def test_package_data_globs_match_real_files():
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]["vitlab"]
    for pattern in globs:
        assert list(PACKAGE.glob(pattern)), f"package-data glob {pattern!r} matches no file under src/vitlab"
    missing = [f for f in _package_files() if not any(fnmatch.fnmatchcase(f, g) for g in globs)]
    assert not missing, f"not in the wheel (add a package-data glob in pyproject.toml): {missing}"
    for needed in ("py.typed", "data/bundled/fashion_mnist_subset.npz", "data/bundled/maps/fashion-mnist-footwear-in1k.txt"):
        assert any(fnmatch.fnmatchcase(needed, g) for g in globs), needed


def test_licence_readme_and_sdist_manifest():
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert PROJECT["readme"]["content-type"] == "text/markdown"
    assert "## Install" in (ROOT / PROJECT["readme"]["file"]).read_text()
    assert "include CHANGELOG.md" in (ROOT / "MANIFEST.in").read_text().splitlines()


def test_extras_and_entry_point():
    extras = PROJECT["optional-dependencies"]
    wanted = {"hf": "datasets", "tensorboard": "tensorboard", "wandb": "wandb"}
    names = {extra: [re.split(r"[<>=!~\[;]", r)[0].strip() for r in reqs] for extra, reqs in extras.items()}
    for extra, package in wanted.items():
        assert package in names[extra], (extra, extras[extra])
        assert package in names["test"], f"CI installs .[test]: add {package} to the test extra"
    assert PROJECT["scripts"]["vitlab"] == "vitlab.cli:main"
    assert PYPROJECT["build-system"]["build-backend"] == "setuptools.build_meta"
