"""The teaching notebooks execute headless, cell by cell, and each draws at least one figure.

A notebook's own ``assert`` statements check its results, so a wrong result fails here as a
``CellExecutionError``, like any exception in a cell.
"""

from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))


def test_the_six_notebooks_are_there():
    assert [path.name for path in PATHS] == [
        "01_the_four_steps.ipynb",
        "02_why_sqrt_dk.ipynb",
        "03_masks.ipynb",
        "04_jit_and_vmap.ipynb",
        "05_your_own_attention.ipynb",
        "06_decoding_with_a_kv_cache.ipynb",
    ]


@pytest.mark.parametrize("path", PATHS, ids=lambda path: path.stem)
def test_notebook_executes_and_draws_a_figure(path):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell

    images = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if "image/png" in output.get("data", {})
    ]
    assert images, f"{path.name} drew no figure"
