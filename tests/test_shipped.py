"""The shipped ladders and evaluation files: found in the source tree, and under
<prefix>/share/ggufcarve where a wheel installs them (pyproject's data-files)."""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib

import ggufcarve.shipped as shipped_module
from ggufcarve.shipped import shipped

ROOT = Path(__file__).resolve().parents[1]


def test_the_source_tree_is_used_when_present():
    assert shipped("evaluation", "gate.toml") == ROOT / "evaluation" / "gate.toml"
    assert shipped("ladders") == ROOT / "ladders"


def test_an_installed_copy_is_used_when_the_tree_has_none(tmp_path, monkeypatch):
    package = tmp_path / "site-packages" / "ggufcarve"
    package.mkdir(parents=True)
    monkeypatch.setattr(shipped_module, "__file__", str(package / "shipped.py"))
    prefix = tmp_path / "prefix"
    gate = prefix / "share" / "ggufcarve" / "evaluation" / "gate.toml"
    gate.parent.mkdir(parents=True)
    gate.write_text("max_kld_mean = 0.1\n")
    monkeypatch.setattr(sys, "prefix", str(prefix))
    assert shipped("evaluation", "gate.toml") == gate
    assert (
        shipped("ladders") == tmp_path / "site-packages" / "ladders"
    )  # neither: the tree's path, for the error message


def test_every_shipped_file_is_in_the_wheel_data_files():
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = {pattern for patterns in doc["tool"]["setuptools"]["data-files"].values() for pattern in patterns}
    files = {
        p.relative_to(ROOT).as_posix() for d in ("ladders", "evaluation") for p in (ROOT / d).rglob("*") if p.is_file()
    }
    covered = {f for f in files if any(Path(f).match(pattern) for pattern in listed)}
    assert covered == files, sorted(files - covered)
