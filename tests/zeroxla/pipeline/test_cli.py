"""`zeroxla train --pipeline-stages S`: the default model trained pipelined (1F1B, --grad-accum
micro-batches), each stage a --mesh of data-parallel devices."""

import json

import pytest

from zeroxla.app import cli, train
from zeroxla.app.job import TrainJobConfig


def test_flag_reaches_the_job():
    args = cli.build_parser().parse_args(["train", "--pipeline-stages", "2", "--mesh", "1x4"])
    assert args.pipeline_stages == 2
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["train", "--pipeline-stages", "0"])
    with pytest.raises(ValueError, match=r"TrainJobConfig.pipeline_stages=0 is invalid; "
                                         r"accepted: an integer >= 1"):
        TrainJobConfig(pipeline_stages=0)


@pytest.mark.slow
def test_train_pipelined(tmp_path):
    # 2 stages x 1 node x 4 local = the 8 test devices; 2 micro-batches of 2 per replica.
    summary = train.run(TrainJobConfig(pipeline_stages=2, mesh=(1, 4), grad_accum=2, steps=3,
                                       batch_size=16, seq_len=32, eval_every=3, eval_batches=1,
                                       sample_tokens=0, progress=False,
                                       out_dir=str(tmp_path / "run")), write=lambda line: None)
    settings = json.loads((tmp_path / "run" / "summary.json").read_text())["settings"]
    assert settings["pipeline_stages"] == 2 and settings["grad_accum"] == 2
    assert summary.final_train_loss < 4.5                    # it ran and trained on something
