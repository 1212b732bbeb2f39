"""The notebooks run from top to bottom, and are stored without outputs so none can go stale."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NEEDS = {"transformers": "torch"}  # it runs a training step on torch.distributed processes
CELL_TIMEOUT_S = 120


def test_the_notebooks_are_there():
    assert {path.stem for path in NOTEBOOKS} >= {"quickstart", "transformers"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_is_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert "widgets" not in notebook.metadata, f"{path.name} holds widget state"
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} cell {index} holds outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs(path, tmp_path):
    needs = NEEDS.get(path.stem)
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{path.name} needs {needs}")
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},  # run from notebooks/, as a user opening it would
    )
    # raises CellExecutionError, naming the cell, on any error; the files a notebook writes land in tmp_path
    # the kernel imports the tree under test (an editable install may point at another checkout)
    path_entries = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    client.execute(env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(path_entries)})
    shown = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert any("text/html" in output.get("data", {}) for output in shown), "a plan displays as its report"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebooks_use_only_the_public_api(path):
    import re

    import autopar

    notebook = nbformat.read(path, as_version=4)
    code = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "code")
    assert not re.search(r"(from|import) autopar\.", code), "a notebook imports autopar's internals"
    used = set(re.findall(r"\bautopar\.(\w+)", code))
    assert used <= set(autopar.__all__), used - set(autopar.__all__)
