"""notebooks/trainer_api.ipynb runs top to bottom with errors disallowed, and TensorBoard's own
reader finds every metrics.jsonl record of its SFT and GRPO trainers (float32) at its step."""

import pytest

from notebook_runner import run_notebook


@pytest.mark.slow
def test_runs_without_errors_and_tensorboard_holds_every_record():
    printed = run_notebook("trainer_api")
    assert "TensorBoard holds every metrics.jsonl record: SFT True, GRPO True" in printed, (
        printed[-2000:])
