"""Notebooks are tests: every notebooks/*.ipynb is stored without outputs and says exactly what
its jupytext pair notebooks/*.py says; each runs top to bottom with errors disallowed in its own
file under tests/notebooks/ (one file each, so pytest-xdist's `--dist loadfile` spreads them
over the workers; `test_every_notebook_is_run` checks none is forgotten).

The .py (percent format) is the source of truth; regenerate the notebook after editing it
(`--update` keeps the stored cell ids, so the .ipynb diff shows only what changed):

    jupytext --update --to ipynb notebooks/quickstart.py

The kernel is "python3", the one ipykernel provides: jupyter_client runs it with this test's own
interpreter (`sys.executable`), so it sees the packages of this environment, nothing else.
"""

import pathlib

import jupytext
import nbformat
import pytest

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))

by_name = pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])


def _cells(notebook: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


def test_every_notebook_has_a_py_pair_and_back():
    assert NOTEBOOKS, f"no notebooks found in {NOTEBOOK_DIR}"
    notebooks = {p.stem for p in NOTEBOOKS}
    scripts = {p.stem for p in NOTEBOOK_DIR.glob("*.py")}
    assert notebooks == scripts, (
        f"unpaired: .ipynb without .py {sorted(notebooks - scripts)}, .py without .ipynb "
        f"{sorted(scripts - notebooks)}; run `jupytext --update --to ipynb notebooks/NAME.py`")


@by_name
def test_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    dirty = [i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"
             and (cell.outputs or cell.execution_count is not None)]
    assert not dirty, (f"{path.name}: cells {dirty} have outputs or execution counts; store it "
                       f"without: `jupytext --update --to ipynb notebooks/{path.stem}.py`")


@by_name
def test_matches_its_py_pair(path):
    stored = nbformat.read(path, as_version=4)
    source = jupytext.read(path.with_suffix(".py"))
    assert _cells(stored) == _cells(source), (
        f"{path.name} and {path.stem}.py differ; the .py is the source of truth: "
        f"`jupytext --update --to ipynb notebooks/{path.stem}.py`")


def test_every_notebook_is_run():
    runners = {p.stem.removeprefix("test_notebook_")
               for p in (pathlib.Path(__file__).parent / "notebooks").glob("test_notebook_*.py")}
    assert runners == {p.stem for p in NOTEBOOKS}, (
        f"notebooks without a runner in tests/notebooks/: "
        f"{sorted({p.stem for p in NOTEBOOKS} - runners)}")
