"""notebooks/grpo.ipynb runs top to bottom with errors disallowed."""

import pytest

from notebook_runner import run_notebook


@pytest.mark.slow
def test_runs_without_errors():
    run_notebook("grpo")
