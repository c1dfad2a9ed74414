"""Run directories: fresh names, refusing to overwrite a run, what --resume accepts, and failed
starts that leave nothing behind."""

import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zeroxla.app import cli
from zeroxla.app.run import rundir

NOW = datetime.datetime(2025, 6, 14, 9, 30, 12)


def make_run(directory: Path, steps=(2, 4)) -> Path:
    """A directory that looks like a finished run: metrics, summary, committed checkpoints."""
    directory.mkdir(parents=True)
    (directory / rundir.METRICS_FILE).write_text(
        "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, steps[-1] + 1)))
    (directory / rundir.SUMMARY_FILE).write_text("{}")
    for s in steps:
        step_dir = directory / rundir.CHECKPOINT_DIR / str(s)
        (step_dir / "zeroxla").mkdir(parents=True)
        (step_dir / "commit_success.txt").write_text("")
    return directory


def snapshot(directory: Path) -> dict:
    """Every file under `directory` with its content hash and modification time."""
    return {str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                            p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_default_run_dir_is_fresh_and_named_by_model_and_time(tmp_path):
    first = rundir.default_run_dir("gpt-tiny", now=NOW, root=tmp_path)
    assert first == tmp_path / "gpt-tiny-20250614-093012"
    first.mkdir()
    second = rundir.default_run_dir("gpt-tiny", now=NOW, root=tmp_path)
    assert second == tmp_path / "gpt-tiny-20250614-093012-2"
    second.mkdir()
    assert rundir.default_run_dir("gpt-tiny", now=NOW, root=tmp_path).name.endswith("-3")


def test_out_dir_holding_a_run_is_refused_naming_resume_and_a_fresh_path(tmp_path):
    run = make_run(tmp_path / "run")
    with pytest.raises(rundir.RunDirError) as err:
        rundir.check_out_dir(run)
    message = str(err.value)
    assert f"--out {run} already holds a run (metrics.jsonl, summary.json, checkpoint/)" in message
    assert f"--resume {run}" in message and f"--out {run}-2" in message
    rundir.check_out_dir(run, resuming=run)                 # continuing that very run is fine
    rundir.check_out_dir(tmp_path / "new")                  # absent
    (tmp_path / "empty").mkdir()
    rundir.check_out_dir(tmp_path / "empty")                # empty, or without run files
    (tmp_path / "file").write_text("x")
    with pytest.raises(rundir.RunDirError, match="is a file"):
        rundir.check_out_dir(tmp_path / "file")


def test_resume_is_offered_only_where_it_exists(tmp_path):
    run = make_run(tmp_path / "run")
    for resumable in (True, False):
        with pytest.raises(rundir.RunDirError) as err:
            rundir.check_out_dir(run, resumable=resumable)
        assert ("--resume" in str(err.value)) == resumable            # reward, ppo: no --resume
        assert f"--out {run}-2" in str(err.value)
    assert f"or delete {run} to redo it" in str(err.value)
    # A run with metrics but no checkpoint/ has nothing --resume could continue.
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / rundir.METRICS_FILE).write_text('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(rundir.RunDirError, match=r"already holds a run \(metrics.jsonl\)") as err:
        rundir.check_out_dir(partial)
    assert "--resume" not in str(err.value)


@pytest.mark.parametrize("failure", [RuntimeError("disk full"), KeyboardInterrupt()],
                         ids=["error", "ctrl-c"])
def test_a_failed_job_removes_what_it_wrote_and_nothing_else(tmp_path, failure):
    # A directory the job created, with parents: all of it goes.
    out = tmp_path / "runs" / "rm"
    with pytest.raises(type(failure)):
        with rundir.removed_unless_saved(out):
            out.mkdir(parents=True)
            (out / rundir.METRICS_FILE).write_text("{}\n")
            raise failure
    assert sorted(os.listdir(tmp_path)) == []
    # A directory that was there: only the entries the job added go.
    given = tmp_path / "given"
    given.mkdir()
    (given / "notes.txt").write_text("mine")
    with pytest.raises(type(failure)):
        with rundir.removed_unless_saved(given):
            (given / rundir.METRICS_FILE).write_text("{}\n")
            (given / rundir.CHECKPOINT_DIR / "1").mkdir(parents=True)
            raise failure
    assert sorted(os.listdir(given)) == ["notes.txt"]
    rundir.check_out_dir(given, resumable=False)         # the same --out is accepted again
    # A job that succeeds keeps everything.
    with rundir.removed_unless_saved(out):
        out.mkdir(parents=True)
        (out / rundir.SUMMARY_FILE).write_text("{}")
    assert os.listdir(out) == [rundir.SUMMARY_FILE]


def test_resume_accepts_a_run_its_checkpoint_dir_or_one_step(tmp_path):
    run = make_run(tmp_path / "run")
    ckpt = run / rundir.CHECKPOINT_DIR
    assert rundir.locate_resume(run) == rundir.ResumePoint(ckpt, None, run)
    assert rundir.locate_resume(ckpt) == rundir.ResumePoint(ckpt, None, run)
    assert rundir.locate_resume(ckpt / "2") == rundir.ResumePoint(ckpt, 2, run)
    elsewhere = tmp_path / "saved"
    shutil.copytree(ckpt, elsewhere)                        # zeroxla.save's dir, not in a run
    assert rundir.locate_resume(elsewhere) == rundir.ResumePoint(elsewhere, None, None)
    with pytest.raises(rundir.RunDirError, match="no such directory; accepted: a run directory"):
        rundir.locate_resume(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(rundir.RunDirError, match="holds no checkpoints"):
        rundir.locate_resume(tmp_path / "empty")


def test_metrics_read_back_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rundir.write_metrics(path, [{"step": 1, "loss": 2.0}, {"step": 1, "val_loss": 2.5}])
    with open(path, "a") as f:
        f.write('{"step": 2, "lo')                          # killed mid-write
    assert rundir.read_metrics(path) == [{"step": 1, "loss": 2.0}, {"step": 1, "val_loss": 2.5}]
    assert rundir.read_metrics(tmp_path / "absent.jsonl") == []


def test_cli_refuses_an_out_dir_holding_a_run_before_jax_starts(tmp_path):
    """A subprocess whose JAX_PLATFORMS names no platform: starting any JAX backend would fail
    there, so the refusal (exit 2, its message) shows that it read the file system only."""
    run = make_run(tmp_path / "run")
    before = snapshot(run)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "no_such_platform"
    result = subprocess.run([sys.executable, "-m", "zeroxla", "train", "--out", str(run),
                             "--steps", "3"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "already holds a run" in result.stderr and f"--resume {run}" in result.stderr
    assert "no_such_platform" not in result.stderr                  # no backend was asked for
    assert "zeroxla train: run directory" not in result.stdout     # the job never started
    assert snapshot(run) == before                                  # no file of that run changed


@pytest.mark.parametrize("argv", [
    ["--batch-size", "30"],                                 # bad option value (recipe)
    ["--seq-len", "512"],                                   # bad option value (model)
    ["--data", "missing.txt"],                              # missing data
    ["--data", "latin1.txt"],                               # data that is not UTF-8
], ids=["batch", "seq-len", "missing-data", "bad-data"])
def test_failed_start_leaves_no_directory(argv, tmp_path, monkeypatch, capsys):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 100)
    monkeypatch.chdir(tmp_path)
    for out in ([], ["--out", "explicit/run"]):            # the default runs/... and a given one
        assert cli.main(["train", "--no-progress", *out, *argv]) == 2
        assert "error" in capsys.readouterr().err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["latin1.txt"]


def test_claim_is_exclusive_and_checks_under_its_lock(tmp_path):
    """Two claims of one directory (two open descriptions: what two processes hold): the second
    is refused with the usual 'already holds a run' message until the first is released."""
    out = tmp_path / "runs" / "a"
    first = rundir.claim(out, fresh=False)
    assert first.created == tmp_path / "runs" and out.is_dir()
    with pytest.raises(rundir.RunDirError,
                       match=r"already holds a run \(another zeroxla job is writing to it now\)"):
        rundir.claim(out, fresh=False)
    first.release()
    second = rundir.claim(out, fresh=False)         # free again, and still holds no run
    (out / rundir.METRICS_FILE).write_text("")
    second.release()
    with pytest.raises(rundir.RunDirError, match=r"already holds a run \(metrics.jsonl\)"):
        rundir.claim(out, fresh=False)
    resumed = rundir.claim(out, fresh=False, resuming=out)    # the run being resumed
    resumed.release()
    with pytest.raises(rundir.RunDirError, match="created by another job meanwhile"):
        rundir.claim(out, fresh=True)
