"""The bench scripts (bench/*.py, not a package: they import each other as top-level modules) as modules
of this process, so a test runs one with `main(argv)` instead of starting a second interpreter."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def import_bench(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """bench/<name>.py, with bench/ on sys.path for the test's duration (its sibling imports need it)."""
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve().parent == BENCH_DIR, f"{name!r} is not the bench's own module"
    return module
