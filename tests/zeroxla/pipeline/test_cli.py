"""`zeroxla train --pipeline-stages S`: the default model trained pipelined (1F1B, --grad-accum
micro-batches), each stage a --mesh of data-parallel devices."""

import json

import numpy as np
import pytest

from zeroxla.app import cli
from zeroxla.app.jobs.train import config
from zeroxla.app.jobs.train import job as train_job
from zeroxla.app.jobs.train.resolve import resolve_job


def test_flag_reaches_the_job():
    args = cli.build_parser().parse_args(["train", "--pipeline-stages", "2", "--mesh", "1x4"])
    assert args.pipeline_stages == 2
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["train", "--pipeline-stages", "0"])
    with pytest.raises(ValueError, match=r"TrainJobConfig.pipeline.stages=0 is invalid; "
                                         r"accepted: an integer >= 1"):
        config.Pipeline(stages=0)
    assert resolve_job({"pipeline_stages": 2, "mesh": (1, 4)}).pipeline.stages == 2


def _train_losses(tmp_path, name, **options):
    """Per-step training losses (metrics.jsonl) and settings of a short `zeroxla train` job."""
    out = tmp_path / name
    train_job.run(resolve_job(dict(mesh=(1, 4), grad_accum=2, steps=3, batch_size=16, seq_len=32,
                              eval_every=3, eval_batches=1, sample_tokens=0, progress=False,
                              out_dir=str(out), **options)), write=lambda line: None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    settings = json.loads((out / "summary.json").read_text())["settings"]
    return [r["loss"] for r in records if "loss" in r], settings


@pytest.mark.slow
def test_train_pipelined(tmp_path):
    """2 stages x 1 node x 4 local = the 8 test devices, 2 micro-batches of 2 per replica,
    against the same job unpipelined (4 data devices, the same 2 micro-batches accumulated):
    the same per-step losses (measured equal to the last bit; rtol 1e-6)."""
    losses, settings = _train_losses(tmp_path, "pipelined", pipeline_stages=2)
    assert settings["pipeline_stages"] == 2 and settings["grad_accum"] == 2
    expected, plain = _train_losses(tmp_path, "unpipelined")
    assert plain["pipeline_stages"] == 1
    assert len(losses) == len(expected) == 3
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    assert losses[-1] < losses[0]                                       # and it trains
