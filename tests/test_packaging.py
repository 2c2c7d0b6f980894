"""The five code folders ship under one `batchgen` namespace, in a regular and an editable install."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "engine/models", "kernels", "connectors", "operators", "pipelines")


def test_wheel_maps_every_code_folder_under_batchgen_and_nothing_else(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True)
    [wheel] = tmp_path.glob("batchgen-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("batchgen-")}
    assert tops == {"batchgen"}  # no bare `engine`, `tests` or `bench` package
    for package in PACKAGES:
        sources = sorted(p.name for p in (ROOT / package).glob("*.py"))
        shipped = sorted(n.rsplit("/", 1)[1] for n in names
                         if n.rsplit("/", 1)[0] == f"batchgen/{package}" and n.endswith(".py"))
        assert shipped == sources, package

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    probe = ("import batchgen, batchgen.engine, batchgen.kernels.ops, batchgen.connectors.checkpoint;"
             "print(batchgen.__file__); print(batchgen.Engine.__module__)")
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0].startswith(str(target)) and out[1] == "batchgen.engine.engine"


def test_editable_install_resolves_to_the_checkout_without_bare_packages(tmp_path):
    probe = ("import importlib.util, batchgen.engine.engine as e; print(e.__file__);"
             "print(importlib.util.find_spec('engine') is None, importlib.util.find_spec('kernels') is None)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout.split()
    assert Path(out[0]) == ROOT / "engine" / "engine.py"
    assert out[1:] == ["True", "True"]
