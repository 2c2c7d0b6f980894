"""notebooks/quickstart.ipynb runs top to bottom in a fresh kernel and shows its results and plot."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # end to end on a Ray runtime

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)  # the kernel joins this session's Ray runtime
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's scratch folder, under the test's own
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "rows: 24, in input order: True" in printed
    assert "rows with an error: 0" in printed
    assert any("image/png" in o.get("data", {}) for o in outputs), "the completion-time plot is missing"
