"""Runs one notebook of notebooks/ top to bottom, errors disallowed (tests/notebooks/)."""

import pathlib

import nbformat
from nbclient import NotebookClient

import xla_flags

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
CELL_TIMEOUT_S = 300


def run_notebook(name: str, *, codegen_flags: bool = True) -> str:
    """Executes notebooks/NAME.ipynb in a "python3" kernel (this interpreter, this environment;
    it inherits the test run's compilation cache, and its XLA flags, or with `codegen_flags`
    False XLA's default codegen, as a user's kernel compiles: faster for a notebook whose time
    is running its programs, not compiling them; `xla_flags.child_environ`); raises
    CellExecutionError, naming the cell, on the first error. Returns what the cells printed
    (their stdout streams, in order), for tests that check a figure the notebook reports."""
    path = NOTEBOOK_DIR / f"{name}.ipynb"
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute(env=xla_flags.child_environ(codegen_flags=codegen_flags))
    return "".join(output.get("text", "") for cell in notebook.cells
                   if cell.cell_type == "code" for output in cell.get("outputs", [])
                   if output.get("output_type") == "stream" and output.get("name") == "stdout")
