"""The job config, its record in checkpoints, resume merging, and --dtype / --grad-accum in the
recipe (with and without a DeepSpeed config). No devices."""

import json
import os
import warnings

import pytest

from zeroxla.app import cli
from zeroxla.app.job import TrainJobConfig, job_record, resumed_fields
from zeroxla.app.train_options import describe_resume
from zeroxla.app.recipe import resolve_setup
from zeroxla.deepspeed.config import DeepSpeedConfigWarning

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples")


def resolve_quietly(**fields):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        return resolve_setup(TrainJobConfig(**fields))


def test_new_train_options_parse_and_default_to_none():
    args = cli.build_parser().parse_args(
        ["train", "--dtype", "bf16", "--grad-accum", "2", "--save-every", "10",
         "--keep-last", "3", "--resume", "runs/x"])
    assert (args.dtype, args.grad_accum, args.save_every, args.keep_last, args.resume) == (
        "bf16", 2, 10, 3, "runs/x")
    defaults = cli.build_parser().parse_args(["train"])
    # None = "not given": --resume restores the run's value, else the job's default applies.
    for name in ("model", "mesh", "dtype", "grad_accum", "seed", "out_dir", "save_every", "steps"):
        assert getattr(defaults, name) is None, name


@pytest.mark.parametrize("argv", [["train", "--dtype", "fp8"], ["train", "--grad-accum", "0"],
                                  ["train", "--keep-last", "-1"], ["train", "--save-every", "x"],
                                  ["launch", "--nproc", "0", "--", "true"]])
def test_bad_new_options_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert "invalid" in capsys.readouterr().err


def test_dtype_and_grad_accum_reach_the_zero_config():
    setup = resolve_setup(TrainJobConfig(dtype="fp16", grad_accum=2, batch_size=32))
    assert setup.zero.compute_dtype == "float16" and setup.zero.uses_loss_scaling
    assert setup.zero.loss_scale == 0                       # 0 = dynamic, as in DeepSpeed
    assert setup.zero.gradient_accumulation_steps == 2
    assert resolve_setup(TrainJobConfig(dtype="bf16")).zero.compute_dtype == "bfloat16"
    assert resolve_setup(TrainJobConfig()).zero.compute_dtype == "float32"
    with pytest.raises(ValueError, match="--batch-size 24 is not a multiple of the 8 data-parallel "
                                         "devices of --mesh 2x4 x --grad-accum 2; use 16"):
        resolve_setup(TrainJobConfig(batch_size=24, grad_accum=2))


def test_dtype_and_grad_accum_merge_into_a_deepspeed_config(tmp_path):
    fp16 = os.path.join(EXAMPLES, "ds_fp16.json")          # fp16, accumulation 2, micro 2
    assert resolve_quietly(deepspeed_config=fp16, dtype="fp16",
                           grad_accum=2).zero.compute_dtype == "float16"
    with pytest.raises(ValueError, match="--dtype bf16 conflicts with fp16.enabled=true in"):
        resolve_quietly(deepspeed_config=fp16, dtype="bf16")
    with pytest.raises(ValueError, match="--grad-accum 4 conflicts with "
                                         "gradient_accumulation_steps=2 in"):
        resolve_quietly(deepspeed_config=fp16, grad_accum=4)
    plain = tmp_path / "ds.json"
    plain.write_text(json.dumps({"train_batch_size": 32, "zero_optimization": {"stage": 2}}))
    setup = resolve_quietly(deepspeed_config=str(plain), dtype="bf16", grad_accum=2)
    assert (setup.zero.compute_dtype, setup.zero.gradient_accumulation_steps,
            setup.batch_size) == ("bfloat16", 2, 32)


def test_a_hybrid_engine_section_the_job_does_not_use_is_said(tmp_path):
    from zeroxla.deepspeed import DeepSpeedConfigWarning

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 32,
                                "hybrid_engine": {"inference_tp_size": 2}}))
    with pytest.warns(DeepSpeedConfigWarning, match="end-of-run sample does not read it"):
        resolve_setup(TrainJobConfig(deepspeed_config=str(path)))


@pytest.mark.parametrize("field,value", [("dtype", "fp8"), ("grad_accum", 0), ("save_every", -1),
                                         ("keep_last", -2)])
def test_new_job_fields_are_validated(field, value):
    with pytest.raises(ValueError, match=f"TrainJobConfig.{field}=.*accepted"):
        TrainJobConfig(**{field: value})


def test_resume_restores_the_saved_job_unless_given_again(tmp_path):
    data = tmp_path / "corpus.txt"
    saved = job_record(TrainJobConfig(mesh=(1, 4), zero_stage=2, dtype="bf16", steps=10,
                                      data=str(data), out_dir="o", resume="r"))
    assert saved["mesh"] == [1, 4] and saved["data"] == str(data.absolute())
    assert "out_dir" not in saved and "resume" not in saved          # per invocation
    assert json.loads(json.dumps(saved)) == saved                    # JSON as it is
    fields = resumed_fields(saved, {"steps": 20, "mesh": (2, 4)})
    job = TrainJobConfig(**fields)
    assert (job.mesh, job.zero_stage, job.dtype, job.steps) == ((2, 4), 2, "bf16", 20)
    assert resumed_fields({**saved, "field_of_the_future": 1}, {}) == resumed_fields(saved, {})
    assert TrainJobConfig(**resumed_fields(None, {"seed": 3})).seed == 3


def test_describe_resume_says_what_was_kept_and_what_changed():
    settings = {"model": "gpt-tiny", "mesh": "1x4", "zero_stage": 2, "dtype": "bf16",
                "grad_accum": 1, "batch_size": 16, "seq_len": 64, "steps": 10}
    kept, changed = describe_resume(settings, {"steps": 20, "mesh": (2, 4), "seq_len": 64})
    assert "--mesh" not in kept and "--zero-stage 2" in kept and "--dtype bf16" in kept
    assert changed == "resume: changed on the command line: --steps 10 -> 20, --mesh 1x4 -> 2x4"
    assert "records no zeroxla train settings" in describe_resume(None, {})[0]


def test_offload_options_reach_the_zero_config(tmp_path):
    assert resolve_setup(TrainJobConfig(offload_optimizer="cpu")).zero.offload_optimizer == "cpu"
    assert resolve_setup(TrainJobConfig()).zero.offload_optimizer == "none"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 32, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "none"}}}))
    with pytest.raises(ValueError, match="--offload-optimizer cpu conflicts with "
                                         "zero_optimization.offload_optimizer"):
        resolve_quietly(deepspeed_config=str(path), offload_optimizer="cpu")
    path.write_text(json.dumps({"train_batch_size": 32, "zero_optimization": {"stage": 2}}))
    assert resolve_quietly(deepspeed_config=str(path),
                           offload_optimizer="cpu").zero.offload_optimizer == "cpu"
