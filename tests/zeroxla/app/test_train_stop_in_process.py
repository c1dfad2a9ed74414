"""Ctrl-C during `zeroxla train`, in this process (seconds): the final save holds the last
finished step, under its number and with the data position `--resume` continues from.

The SIGINT is sent from the job's own `write` callback when it reports step 2 (the line after
the step's evaluation), so it lands at one known moment with nothing patched; the slow
subprocess tests (test_train_signals.py) land it at every other moment. The reference is the
step count itself: two finished steps, logged as steps 1 and 2.
"""

import os
import signal

import pytest

from zeroxla import checkpoint
from zeroxla.app.run import rundir
from zeroxla.app.run import runner
from zeroxla.app.run.resume import RECORD_KEY
from zeroxla.app.jobs.train import job as train_job
from zeroxla.app.jobs.train.resolve import resolve_job
from zeroxla.app.jobs.train.resume import saved_job

# One device, no partitioning: the cheapest step to compile (the saves do not depend on it).
TINY = {"batch_size": 8, "seq_len": 16, "eval_batches": 1, "sample_tokens": 0,
        "mesh": (1, 1), "zero_stage": 0, "progress": False}
STOP_AFTER = 2


def test_ctrl_c_saves_the_last_finished_step_where_resume_reads_it(tmp_path):
    out = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)

    def write(line):                     # "step      2: train loss ... validation loss ..."
        if line.startswith("step") and int(line.split(":")[0].split()[-1]) == STOP_AFTER:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(runner.RunInterrupted) as stopped:
        train_job.run(resolve_job({"steps": 5, "eval_every": STOP_AFTER, "out_dir": str(out),
                              **TINY}), write=write)
    assert signal.getsignal(signal.SIGINT) is before                   # handler restored
    finished = [r["step"] for r in rundir.read_metrics(out / rundir.METRICS_FILE) if "loss" in r]
    assert finished == list(range(1, STOP_AFTER + 1))
    assert stopped.value.done == STOP_AFTER and stopped.value.signum == signal.SIGINT
    assert stopped.value.path == (out / "checkpoint" / str(STOP_AFTER)).absolute()
    assert [c.step for c in checkpoint.list_checkpoints(out / "checkpoint")
            if c.complete] == [STOP_AFTER]
    metadata = checkpoint.read_metadata(out / "checkpoint")["metadata"]
    assert metadata[RECORD_KEY]["done"] == STOP_AFTER

    # What `zeroxla train --resume RUN --steps 5` reads: the job, the state and where the data
    # continues: the run goes on from step 3 and logs it.
    lines = []
    job = saved_job(metadata, {"resume": str(out), "steps": 5})
    summary = train_job.run(job, write=lines.append)
    assert (f"resumed from {(out / 'checkpoint' / str(STOP_AFTER)).absolute()} after step "
            f"{STOP_AFTER}") in lines
    finished = [r["step"] for r in rundir.read_metrics(out / rundir.METRICS_FILE) if "loss" in r]
    assert finished == [1, 2, 3, 4, 5] and summary.resumed_from_step == STOP_AFTER
