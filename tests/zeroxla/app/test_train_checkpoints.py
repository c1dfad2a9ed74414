"""Checkpoints during `zeroxla train`: --save-every / --keep-last, Ctrl-C, --resume.

In-process runs of the tiny GPT on the 8 test devices (a few seconds each). The Ctrl-C test sends
a real SIGINT to this process from a helper thread once the run has logged a few steps.
"""

import contextlib
import io
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from zeroxla import checkpoint
from zeroxla.app import cli
from zeroxla.app.run import rundir
from zeroxla.app.jobs.train import job as train_job
from zeroxla.app.jobs.train.resolve import resolve_job
from zeroxla.app.jobs.train.resume import FLAT_RECORD_KEY, RECORD_KEY
from zeroxla.checkpoint.integrity import digest

# Compiles many steps: in the full suite, not in the daily `-m "not slow"` subset.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]

SMALL = {"batch_size": 8, "seq_len": 32, "eval_batches": 1, "sample_tokens": 0,
         "progress": False}
SMALL_ARGS = ["--batch-size", "8", "--seq-len", "32", "--eval-batches", "1",
              "--sample-tokens", "0", "--no-progress"]


def train_steps(run_dir):
    return [r["step"] for r in rundir.read_metrics(run_dir / rundir.METRICS_FILE) if "loss" in r]


def committed(directory):
    return [c.step for c in checkpoint.list_checkpoints(directory) if c.complete]


def test_save_every_and_keep_last(tmp_path):
    run_dir = tmp_path / "run"
    seen = {}

    def write(line):                    # called right after each periodic save (and prune)
        if "saved checkpoint" in line:
            seen[int(line.split(":")[0].split()[-1])] = committed(run_dir / "checkpoint")

    summary = train_job.run(resolve_job({"steps": 7, "save_every": 2, "keep_last": 2,
                                    "out_dir": str(run_dir), **SMALL}), write=write)
    # Each save commits before older steps go: the newest two committed ones are always there.
    assert seen == {2: [2], 4: [2, 4], 6: [4, 6]}
    assert committed(run_dir / "checkpoint") == [6, 7]      # the final save, always
    assert sorted(os.listdir(run_dir / "checkpoint")) == ["6", "7"]
    assert summary.paths["checkpoint"] == str((run_dir / "checkpoint" / "7").absolute())

    written = json.loads((run_dir / "summary.json").read_text())
    settings = written["settings"]
    expected = {"model": "gpt-tiny", "steps": 7, "batch_size": 8, "seq_len": 32, "lr": 0.01,
                "mesh": "2x4", "zero_stage": 3, "dtype": "fp32", "grad_accum": 1, "seed": 0,
                "save_every": 2, "keep_last": 2, "tokenizer": "char", "processes": 1}
    assert {k: settings[k] for k in expected} == expected
    assert all(v is not None for v in settings.values()), settings
    # Every checkpoint records the job's tree, the settings and the tokenizer (for --resume,
    # export).
    meta = checkpoint.read_metadata(run_dir / "checkpoint")["metadata"]
    assert meta["run_record"]["done"] == 7 and meta["settings"] == settings
    assert meta[RECORD_KEY]["run"]["save_every"] == 2 and meta["tokenizer"]["kind"] == "char"


def _interrupt_after(metrics_path, steps, done):
    """Sends SIGINT to this process once `metrics_path` has `steps` train records."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not done.is_set():
        if metrics_path.exists() and metrics_path.read_text().count("grad_norm") >= steps:
            os.kill(os.getpid(), signal.SIGINT)
            return
        time.sleep(0.01)


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory):
    """A run with --mesh 1x4 --zero-stage 2 --dtype bf16, stopped by Ctrl-C after a few steps;
    returns (run dir, the step it stopped at, stderr)."""
    run_dir = tmp_path_factory.mktemp("interrupted") / "run"
    before = signal.getsignal(signal.SIGINT)    # Python's default; SIG_IGN in an xdist worker
    done = threading.Event()
    sender = threading.Thread(target=_interrupt_after,
                              args=(run_dir / rundir.METRICS_FILE, 3, done))
    sender.start()
    try:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = cli.main(["train", "--steps", "2000", "--mesh", "1x4", "--zero-stage", "2",
                               "--dtype", "bf16", "--out", str(run_dir), *SMALL_ARGS])
    finally:
        done.set()
        sender.join()
    assert signal.getsignal(signal.SIGINT) is before                       # handler restored
    return run_dir, status, err.getvalue()


def test_ctrl_c_saves_the_current_step_and_says_how_to_resume(interrupted_run):
    run_dir, status, err = interrupted_run
    stopped = train_steps(run_dir)[-1]
    assert status == 130
    assert stopped >= 3 and train_steps(run_dir) == list(range(1, stopped + 1))
    assert committed(run_dir / "checkpoint") == [stopped]
    assert (f"interrupted (Ctrl-C) after step {stopped}; saved checkpoint "
            f"{(run_dir / 'checkpoint' / str(stopped)).absolute()}") in err
    assert f"resume with: zeroxla train --resume {run_dir}" in err
    assert (run_dir / rundir.PLOT_FILE).exists() and not (run_dir / rundir.SUMMARY_FILE).exists()


def test_resume_restores_stage_mesh_and_dtype_and_appends_metrics(interrupted_run, tmp_path,
                                                                  capsys):
    original, _, _ = interrupted_run
    run_dir = tmp_path / "run"
    shutil.copytree(original, run_dir)
    stopped = train_steps(run_dir)[-1]
    with open(run_dir / rundir.METRICS_FILE, "a") as f:     # logged, but after the checkpoint
        f.write(json.dumps({"step": stopped + 1, "loss": 99.0}) + "\n")
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run_dir), "--steps", str(stopped + 2),
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert ("resume: kept from the run: --model gpt-tiny, --mesh 1x4, --zero-stage 2, "
            "--dtype bf16") in out
    assert f"--steps 2000 -> {stopped + 2}" in out
    assert f"resumed from {(run_dir / 'checkpoint' / str(stopped)).absolute()}" in out
    assert "ZeRO-2 on a 1x4 mesh" in out
    records = rundir.read_metrics(run_dir / rundir.METRICS_FILE)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, stopped + 3))
    assert 99.0 not in [r["loss"] for r in records if "loss" in r]      # redone, not kept
    summary = json.loads((run_dir / rundir.SUMMARY_FILE).read_text())
    assert (summary["settings"]["mesh"], summary["settings"]["zero_stage"],
            summary["settings"]["dtype"], summary["settings"]["steps"]) == ("1x4", 2, "bf16",
                                                                            stopped + 2)
    assert summary["tokens_seen"] == (stopped + 2) * 8 * 32           # the whole run
    assert summary["resumed_from_step"] == stopped
    assert committed(run_dir / "checkpoint") == [stopped, stopped + 2]


def test_resume_into_a_fresh_out_carries_the_earlier_metrics(interrupted_run, tmp_path, capsys):
    original, _, _ = interrupted_run
    stopped = train_steps(original)[-1]
    fork = tmp_path / "fork"
    assert cli.main(["train", "--resume", str(original), "--out", str(fork), "--steps",
                     str(stopped + 1), "--zero-stage", "3", "--no-progress"]) == 0
    assert "--zero-stage 2 -> 3" in capsys.readouterr().out
    assert train_steps(fork) == list(range(1, stopped + 2))
    assert committed(fork / "checkpoint") == [stopped + 1]
    assert committed(original / "checkpoint") == [stopped]              # untouched


def _as_an_older_zeroxla_wrote_it(directory, step):
    """Rewrites checkpoint `step`'s metadata as an older zeroxla stored it: the job as the flat
    record that zeroxla wrote for the interrupted run's command line (tests/assets), instead of
    the tree; the digest recomputed, as that zeroxla computed it."""
    fixture = json.loads((ROOT / "tests" / "assets" / "checkpoints" /
                          "flat_job_metadata.json").read_text())["cli"]
    path = directory / str(step) / "zeroxla" / "metadata"
    meta = json.loads(path.read_text())
    del meta["metadata"][RECORD_KEY]
    meta["metadata"][FLAT_RECORD_KEY] = fixture[FLAT_RECORD_KEY]
    meta["digest"] = digest(meta)
    path.write_text(json.dumps(meta))


def test_a_checkpoint_of_an_older_zeroxla_resumes_as_it_ran(interrupted_run, tmp_path, capsys):
    """The flat record of a run made before the config tree: --resume rebuilds the same job
    (stage 2 on a 1x4 mesh in bf16, the command line's other settings) from it."""
    original, _, _ = interrupted_run
    run_dir = tmp_path / "old"
    shutil.copytree(original, run_dir)
    stopped = train_steps(run_dir)[-1]
    _as_an_older_zeroxla_wrote_it(run_dir / "checkpoint", stopped)
    assert RECORD_KEY not in checkpoint.read_metadata(run_dir / "checkpoint")["metadata"]
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(run_dir), "--steps", str(stopped + 1),
                     "--no-progress"]) == 0
    assert "ZeRO-2 on a 1x4 mesh" in capsys.readouterr().out
    settings = json.loads((run_dir / rundir.SUMMARY_FILE).read_text())["settings"]
    assert {k: settings[k] for k in ("mesh", "zero_stage", "dtype", "batch_size", "seq_len",
                                     "steps", "persistence_threshold", "gradient_clipping")} == {
        "mesh": "1x4", "zero_stage": 2, "dtype": "bf16", "batch_size": 8, "seq_len": 32,
        "steps": stopped + 1, "persistence_threshold": 0, "gradient_clipping": 1.0}
    assert committed(run_dir / "checkpoint") == [stopped, stopped + 1]
