"""Checkpoint retention: only committed steps count, the newest K stay, deletion is atomic."""

import pytest

from zeroxla import checkpoint
from zeroxla.checkpoint.retention import DELETING_SUFFIX, prune_checkpoints, steps_to_delete


def fake_step(directory, step, *, committed=True):
    """A step directory as zeroxla.save leaves it (committed) or an interrupted save."""
    path = directory / (str(step) if committed else f"{step}{checkpoint.TMP_SUFFIX}")
    (path / checkpoint.META_ITEM).mkdir(parents=True)
    (path / "state").mkdir()
    (path / "state" / "data").write_bytes(b"x" * 100)
    if committed:
        (path / checkpoint.COMMIT_FILE).write_text("")
    return path


def test_steps_to_delete_keeps_the_newest():
    assert steps_to_delete([30, 10, 20, 40], 2) == [10, 20]
    assert steps_to_delete([10], 3) == []
    with pytest.raises(ValueError, match="keep_last=0 is invalid; accepted: an integer >= 1"):
        steps_to_delete([1], 0)


def test_prune_counts_only_committed_steps(tmp_path):
    for step in (10, 20, 30):
        fake_step(tmp_path, step)
    fake_step(tmp_path, 40, committed=False)        # a newer save still running (or killed)
    assert prune_checkpoints(tmp_path, keep_last=2) == [10]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "20", "30", f"40{checkpoint.TMP_SUFFIX}"]
    assert checkpoint.latest_step(tmp_path) == 30
    assert prune_checkpoints(tmp_path, keep_last=2) == []


def test_prune_finishes_a_deletion_cut_short(tmp_path):
    for step in (1, 2):
        fake_step(tmp_path, step)
    leftover = fake_step(tmp_path, 0)
    leftover.rename(tmp_path / f"0{DELETING_SUFFIX}")   # a crash between rename and removal
    assert [c.step for c in checkpoint.list_checkpoints(tmp_path)] == [1, 2]   # invisible
    assert prune_checkpoints(tmp_path, keep_last=1) == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2"]
