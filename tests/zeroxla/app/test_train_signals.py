"""How a `zeroxla train` run ends when it is stopped or diverges: a SIGINT (Ctrl-C) or SIGTERM
(SLURM, Kubernetes) at any moment of a run keeps a complete checkpoint of the last finished step
and exits 130 / 143; a second signal stops at once; a diverging run exits 1 with a one-line error
naming the step and keeps its last finite state; two jobs on one --out never mix; a resumed run
tokenizes with its own vocabulary. A signal or a second job is a process contract, so those runs
are subprocesses whose exit status is checked, the signal landing at a chosen moment through
`signal_driver.py` or from outside, as a user's would. What a run does with its own state
(divergence, resume) runs `cli.main(argv)` in this process: the status it returns is the exit
status, its stdout and stderr what a terminal shows (`zeroxla/__main__.py` is
`sys.exit(main())`)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import xla_flags
from commands import zeroxla_command

from flax import nnx

from zeroxla import checkpoint
from zeroxla.app import cli
from zeroxla.app.run import rundir

pytestmark = pytest.mark.slow        # each compiles and runs a job

DRIVER = Path(__file__).with_name("signal_driver.py")
TINY = ["--batch-size", "8", "--seq-len", "16", "--eval-batches", "1", "--sample-tokens", "4",
        "--mesh", "1x2", "--no-progress"]


def _env():
    return xla_flags.child_environ()


def _complete(run_dir):
    return [c.step for c in checkpoint.list_checkpoints(run_dir / "checkpoint") if c.complete]


def _train_steps(run_dir):
    return [r["step"] for r in rundir.read_metrics(run_dir / rundir.METRICS_FILE) if "loss" in r]


def _driven(tmp_path, moment, signame, count=1, steps=3):
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(DRIVER), moment, signame, str(count), "--", "train", "--steps",
         str(steps), "--out", str(out), *TINY],
        env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    return out, result


@pytest.mark.parametrize("moment,signame,stopped_after", [
    ("step", "SIGINT", 2), ("logged", "SIGINT", 3), ("save", "SIGINT", 3),
    ("report", "SIGINT", 3), ("save", "SIGTERM", 3), ("step", "SIGTERM", 2)])
def test_a_stop_signal_at_any_moment_keeps_the_last_finished_step(tmp_path, moment, signame,
                                                                  stopped_after):
    out, result = _driven(tmp_path, moment, signame)
    signum = getattr(signal, signame)
    assert result.returncode == 128 + signum, result.stderr[-3000:]
    assert _complete(out) == [stopped_after]
    assert not [p for p in (out / "checkpoint").iterdir() if "tmp" in p.name]
    assert _train_steps(out) == list(range(1, stopped_after + 1))
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert (f"interrupted ({name}) after step {stopped_after}; saved checkpoint "
            f"{(out / 'checkpoint' / str(stopped_after)).absolute()}") in result.stderr
    assert "Traceback" not in result.stderr
    assert not (out / rundir.SUMMARY_FILE).exists()     # the report did not finish


def test_a_second_signal_stops_at_once(tmp_path):
    out, result = _driven(tmp_path, "save", "SIGINT", count=2)
    assert result.returncode == 130, result.stderr[-3000:]
    assert "interrupted (Ctrl-C)" in result.stderr and "Traceback" not in result.stderr
    assert not (out / rundir.SUMMARY_FILE).exists()
    assert 3 not in _complete(out)                       # it did not wait for the save


def _start(args, tmp_path):
    return subprocess.Popen(zeroxla_command(*args), env=_env(), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_from_outside_saves_and_exits_143_then_resume_continues(tmp_path, capsys):
    """As SLURM sends it: an external SIGTERM while the job trains."""
    out = tmp_path / "run"
    proc = _start(["train", "--steps", "100000", "--out", str(out), *TINY], tmp_path)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(_train_steps(out)) < 2:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    done = _train_steps(out)[-1]
    assert _complete(out) == [done] and "interrupted (SIGTERM)" in err
    status = cli.main(["train", "--resume", str(out), "--steps", str(done + 1)])
    assert status == 0, capsys.readouterr().err[-3000:]
    assert _complete(out)[-1] == done + 1


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_a_diverging_run_exits_1_naming_the_step_and_keeps_the_last_finite_state(
        tmp_path, dtype, capsys):
    out = tmp_path / "run"
    status = cli.main(["train", "--lr", "1e30", "--warmup-steps", "0", "--steps", "20",
                       "--dtype", dtype, "--out", str(out), *TINY])
    stderr = capsys.readouterr().err
    assert status == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("zeroxla train:")]
    assert len(errors) == 1 and "(not finite), so training stopped" in errors[0]
    step = int(errors[0].split("error: step ")[1].split(":")[0])
    assert _train_steps(out) == list(range(1, step))     # the diverged step is not logged
    if "holds the parameters" in errors[0]:
        assert _complete(out) == [step]
        meta = checkpoint.read_metadata(out / "checkpoint")
        assert meta["metadata"]["run_record"]["done"] == step
        params = nnx.state(checkpoint.load_params(out / "checkpoint"), nnx.Param)
        assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(params))
    else:                                                # it says why it cannot
        assert "No checkpoint of it was saved" in errors[0]
        assert _complete(out) == []


def test_two_jobs_on_one_out_never_mix(tmp_path):
    out = tmp_path / "shared"
    args = ["train", "--steps", "12", "--save-every", "4", "--out", str(out), *TINY]
    procs = [_start(args, tmp_path) for _ in range(2)]
    results = [(p, *p.communicate(timeout=600)) for p in procs]
    codes = sorted(p.returncode for p, _, _ in results)
    assert codes == [0, 2], [e[-2000:] for _, _, e in results]
    refused = next(err for p, _, err in results if p.returncode == 2)
    assert f"--out {out} already holds a run" in refused and "Traceback" not in refused
    assert _train_steps(out) == list(range(1, 13))         # one run's records, once each
    assert sorted(os.listdir(out / "checkpoint")) == ["12", "4", "8"]
    assert _complete(out) == [4, 8, 12]


def test_resume_tokenizes_with_the_runs_own_vocabulary(tmp_path, capsys):
    letters = tmp_path / "letters.txt"
    letters.write_text("abcdefgh " * 400)
    out = tmp_path / "run"
    first = cli.main(["train", "--data", str(letters), "--steps", "2", "--out", str(out), *TINY])
    assert first == 0, capsys.readouterr().err[-3000:]
    recorded = checkpoint.read_metadata(out / "checkpoint")["metadata"]["tokenizer"]
    assert recorded == {"kind": "char", "chars": " abcdefgh"}

    other = tmp_path / "other.txt"                      # as many characters, other ones
    other.write_text("stuvwxyz " * 400)
    capsys.readouterr()
    refused = cli.main(["train", "--resume", str(out), "--data", str(other), "--steps", "4"])
    assert refused == 2
    assert (f"--data {other} has 8 character(s) the resumed run's tokenizer does not know: "
            "'s', 't', 'u', 'v', 'w', 'x', 'y', 'z'") in capsys.readouterr().err
    assert _complete(out) == [2]

    fewer = tmp_path / "fewer.txt"                       # a subset: fewer characters, same ids
    fewer.write_text("hgfe " * 400)
    resumed = cli.main(["train", "--resume", str(out), "--data", str(fewer), "--steps", "4"])
    output = capsys.readouterr()
    assert resumed == 0, output.err[-3000:]
    assert "vocab 9" in output.out                       # the run's 9 characters, not 5
    meta = checkpoint.read_metadata(out / "checkpoint")["metadata"]
    assert meta["run_record"]["done"] == 4 and meta["tokenizer"] == recorded
    assert json.loads((out / rundir.SUMMARY_FILE).read_text())["steps"] == 4
