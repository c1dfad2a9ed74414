"""The job's config tree: options into it, its record in checkpoints, resume (the tree, and the
flat records an older zeroxla stored), and --dtype / --grad-accum in the recipe (with and without
a DeepSpeed config). No devices."""

import dataclasses
import json
import os
import warnings
from pathlib import Path

import pytest

from zeroxla.app import cli
from zeroxla.app.jobs.train import config
from zeroxla.app.jobs.train.recipe import build_setup
from zeroxla.app.jobs.train.resolve import resolve_job
from zeroxla.app.jobs.train.resume import (FLAT_RECORD_KEY, RECORD_KEY, describe_resume,
                                           job_from_record, job_record, saved_job)
from zeroxla.deepspeed.config import DeepSpeedConfigWarning
from zeroxla.sharding.config import ZeroConfig

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples")
FLAT_METADATA = ROOT / "tests" / "assets" / "checkpoints" / "flat_job_metadata.json"


def resolve_quietly(**given):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        return resolve_job(given)


def test_new_train_options_parse_and_default_to_none():
    args = cli.build_parser().parse_args(
        ["train", "--dtype", "bf16", "--grad-accum", "2", "--save-every", "10",
         "--keep-last", "3", "--resume", "runs/x"])
    assert (args.dtype, args.grad_accum, args.save_every, args.keep_last, args.resume) == (
        "bf16", 2, 10, 3, "runs/x")
    defaults = cli.build_parser().parse_args(["train"])
    # None = "not given": --resume restores the run's value, else the job's default applies.
    for name in ("model", "mesh", "dtype", "grad_accum", "seed", "out_dir", "save_every", "steps",
                 "gradient_clipping", "check_grad_overflow"):
        assert getattr(defaults, name) is None, name


@pytest.mark.parametrize("argv", [["train", "--dtype", "fp8"], ["train", "--grad-accum", "0"],
                                  ["train", "--keep-last", "-1"], ["train", "--save-every", "x"],
                                  ["train", "--gradient-clipping", "nan"],
                                  ["launch", "--nproc", "0", "--", "true"]])
def test_bad_new_options_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert "invalid" in capsys.readouterr().err


def test_dtype_and_grad_accum_reach_the_zero_config():
    setup = build_setup(resolve_job({"dtype": "fp16", "grad_accum": 2, "batch_size": 32}))
    assert setup.zero.compute_dtype == "float16" and setup.zero.uses_loss_scaling
    assert setup.zero.loss_scale == 0                       # 0 = dynamic, as in DeepSpeed
    assert setup.zero.gradient_accumulation_steps == 2
    assert resolve_job({"dtype": "bf16"}).zero_config().compute_dtype == "bfloat16"
    assert resolve_job({}).zero_config().compute_dtype == "float32"
    with pytest.raises(ValueError, match="--batch-size 24 is not a multiple of the 8 data-parallel "
                                         "devices of --mesh 2x4 x --grad-accum 2; use 16"):
        resolve_job({"batch_size": 24, "grad_accum": 2})


def test_dtype_and_grad_accum_merge_into_a_deepspeed_config(tmp_path):
    fp16 = os.path.join(EXAMPLES, "ds_fp16.json")          # fp16, accumulation 2, micro 2
    assert resolve_quietly(deepspeed_config=fp16, dtype="fp16",
                           grad_accum=2).zero_config().compute_dtype == "float16"
    with pytest.raises(ValueError, match="--dtype bf16 conflicts with fp16.enabled=true in"):
        resolve_quietly(deepspeed_config=fp16, dtype="bf16")
    with pytest.raises(ValueError, match="--grad-accum 4 conflicts with "
                                         "gradient_accumulation_steps=2 in"):
        resolve_quietly(deepspeed_config=fp16, grad_accum=4)
    plain = tmp_path / "ds.json"
    plain.write_text(json.dumps({"train_batch_size": 32, "zero_optimization": {"stage": 2}}))
    job = resolve_quietly(deepspeed_config=str(plain), dtype="bf16", grad_accum=2)
    assert (job.zero_config().compute_dtype, job.zero_config().gradient_accumulation_steps,
            job.schedule.batch_size) == ("bfloat16", 2, 32)


def test_a_hybrid_engine_section_the_job_does_not_use_is_said(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 32,
                                "hybrid_engine": {"inference_tp_size": 2}}))
    with pytest.warns(DeepSpeedConfigWarning, match="end-of-run sample does not read it"):
        resolve_job({"deepspeed_config": str(path)})


@pytest.mark.parametrize("section,field,value", [
    (config.Numerics, "compute_dtype", "fp8"), (config.Sharding, "gradient_accumulation_steps", 0),
    (config.Run, "save_every", -1), (config.Run, "keep_last", -2)])
def test_new_job_fields_are_validated(section, field, value):
    with pytest.raises(ValueError, match=f"TrainJobConfig.{section.NAME}.{field}=.*accepted"):
        section(**{field: value})


def test_the_tree_round_trips_through_its_checkpoint_record(tmp_path):
    data = tmp_path / "corpus.txt"
    job = resolve_quietly(
        deepspeed_config=os.path.join(EXAMPLES, "ds_zero3_adamw_warmupdecay.json"), mesh=(1, 4),
        data=str(data), steps=10, out_dir="o", resume="r")
    record = job_record(job)
    assert record["sharding"]["mesh"] == [1, 4] and record["data"]["path"] == str(data.absolute())
    assert {"out_dir", "resume", "progress"}.isdisjoint(record["run"])    # per invocation
    assert record["schedule"]["optimizer"]["type"] == "adamw"
    assert json.loads(json.dumps(record)) == record                      # JSON as it is
    back = job_from_record(json.loads(json.dumps(record)))
    assert back == dataclasses.replace(
        job, data=dataclasses.replace(job.data, path=str(data.absolute())),
        run=dataclasses.replace(job.run, out_dir=None, resume=None),
        deepspeed_config=os.path.abspath(job.deepspeed_config))
    assert float(build_setup(back).learning_rate(51)) == float(build_setup(job).learning_rate(51))


def test_resume_restores_the_saved_tree_unless_given_again(tmp_path):
    saved = {RECORD_KEY: job_record(resolve_job({"mesh": (1, 4), "zero_stage": 2,
                                                 "dtype": "bf16", "steps": 10}))}
    job = saved_job(saved, {"steps": 20, "mesh": (2, 4)})
    assert (job.sharding.mesh, job.sharding.stage, job.numerics.compute_dtype,
            job.schedule.steps) == ((2, 4), 2, "bfloat16", 20)
    newer = json.loads(json.dumps(saved))
    newer[RECORD_KEY]["sharding"]["field_of_the_future"] = 1
    assert saved_job(newer, {}) == saved_job(saved, {})
    assert saved_job({}, {"seed": 3}).run.seed == 3


def _flat_metadata(name):
    """An older zeroxla's checkpoint metadata (tests/assets), its paths made this checkout's."""
    meta = json.loads(FLAT_METADATA.read_text())[name]
    flat = meta[FLAT_RECORD_KEY]
    if flat["deepspeed_config"] is not None:
        flat["deepspeed_config"] = flat["deepspeed_config"].replace(
            "<examples>", os.path.abspath(EXAMPLES))
    return meta


@pytest.mark.parametrize("name", ["cli", "deepspeed"])
def test_a_flat_record_of_an_older_zeroxla_resumes_with_the_settings_it_used(name):
    """The independent reference: the settings that older run used, as it recorded them."""
    meta = _flat_metadata(name)
    assert RECORD_KEY not in meta
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        job = saved_job(meta, {})
        # The command line wins over the flat record, as over a tree.
        again = saved_job(meta, {"steps": 30, "seed": 4})
    zero, used = job.zero_config(), meta["settings"]
    schedule = build_setup(job).learning_rate
    peak = max(float(schedule(k)) for k in range(job.schedule.steps))
    assert {"mesh": "x".join(map(str, job.sharding.mesh)), "zero_stage": zero.stage,
            "persistence_threshold": zero.persistence_threshold,
            "dtype": {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[
                zero.compute_dtype],
            "grad_accum": zero.gradient_accumulation_steps,
            "gradient_clipping": zero.gradient_clipping, "batch_size": job.schedule.batch_size,
            "micro_batch_size": job.micro_batch_size, "steps": job.schedule.steps,
            "seq_len": job.data.seq_len, "tokenizer": job.data.tokenizer,
            "seed": job.run.seed, "eval_every": job.run.eval_every,
            "eval_batches": job.run.eval_batches, "sample_tokens": job.run.sample_tokens,
            "lr": float(f"{peak:.7g}")} == {
        k: used[k] for k in ("mesh", "zero_stage", "persistence_threshold", "dtype",
                             "grad_accum", "gradient_clipping", "batch_size", "micro_batch_size",
                             "steps", "seq_len", "tokenizer", "seed", "eval_every",
                             "eval_batches", "sample_tokens", "lr")}
    assert zero.check_grad_overflow                  # that zeroxla's job checked too
    assert (again.schedule.steps, again.run.seed, again.sharding.stage) == (30, 4, zero.stage)


def test_a_flat_record_reads_its_json_again_as_that_zeroxla_did(tmp_path):
    """Its `gradient_clipping` was the default recipe's, not an option: a --config JSON's own
    clipping (and stage, batch) stays the run's, as when it ran."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 16, "gradient_clipping": 0.5,
                              "zero_optimization": {"stage": 1}}))
    meta = _flat_metadata("deepspeed")
    meta[FLAT_RECORD_KEY]["deepspeed_config"] = str(ds)
    job = saved_job(meta, {})
    assert (job.numerics.gradient_clipping, job.sharding.stage, job.schedule.batch_size,
            job.numerics.compute_dtype) == (0.5, 1, 16, "float32")


def test_describe_resume_says_what_was_kept_and_what_changed():
    settings = {"model": "gpt-tiny", "mesh": "1x4", "zero_stage": 2, "dtype": "bf16",
                "grad_accum": 1, "batch_size": 16, "seq_len": 64, "steps": 10}
    kept, changed = describe_resume(settings, {"steps": 20, "mesh": (2, 4), "seq_len": 64})
    assert "--mesh" not in kept and "--zero-stage 2" in kept and "--dtype bf16" in kept
    assert changed == "resume: changed on the command line: --steps 10 -> 20, --mesh 1x4 -> 2x4"
    assert "records no zeroxla train settings" in describe_resume(None, {})[0]


def test_offload_options_reach_the_zero_config(tmp_path):
    assert resolve_job({"offload_optimizer": "cpu"}).zero_config().offload_optimizer == "cpu"
    assert resolve_job({}).zero_config().offload_optimizer == "none"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 32, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "none"}}}))
    with pytest.raises(ValueError, match="--offload-optimizer cpu conflicts with "
                                         "zero_optimization.offload_optimizer"):
        resolve_quietly(deepspeed_config=str(path), offload_optimizer="cpu")
    path.write_text(json.dumps({"train_batch_size": 32, "zero_optimization": {"stage": 2}}))
    assert resolve_quietly(deepspeed_config=str(path),
                           offload_optimizer="cpu").zero_config().offload_optimizer == "cpu"


def test_the_tree_is_the_zero_config_it_holds():
    """Every ZeroConfig field lives in exactly one engine-facing section, under its own name,
    and the tree's ZeroConfig is those fields: one mapping, no copy. The mesh's own fields
    (its shape, its expert axis) are the sharding section's beside them."""
    mesh_fields = ("mesh", "expert_parallel_size")
    names = [name for cls in config.ENGINE_SECTIONS
             for name in (f.name for f in dataclasses.fields(cls)) if name not in mesh_fields]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(ZeroConfig))
    job = config.TrainJobConfig(sharding=config.Sharding(stage=2, persistence_threshold=7),
                                numerics=config.Numerics(compute_dtype="bfloat16"))
    zero = job.zero_config()
    for cls in config.ENGINE_SECTIONS:
        section = getattr(job, cls.NAME)
        for field in dataclasses.fields(cls):
            if field.name not in mesh_fields:
                assert getattr(zero, field.name) == getattr(section, field.name)
    assert config.engine_sections(zero, (2, 4)) == {cls.NAME: getattr(job, cls.NAME)
                                                    for cls in config.ENGINE_SECTIONS}


@pytest.mark.parametrize("build,message", [
    (lambda: config.TrainJobConfig(sharding=config.Sharding(stage=2),
                                   zeropp=config.ZeroPP(quantized_weights=True)),
     r"TrainJobConfig\.sharding\.stage=2 is invalid; accepted: 3 when ZeRO\+\+"),
    (lambda: config.TrainJobConfig(sharding=config.Sharding(stage=2),
                                   offload=config.Offload(offload_param="cpu")),
     r"TrainJobConfig\.offload\.offload_param='cpu' is invalid; accepted: 'none' below stage 3"),
    (lambda: config.TrainJobConfig(zeropp=config.ZeroPP(hpz_partition_size=3)),
     r"TrainJobConfig\.zeropp\.hpz_partition_size=3 is invalid; accepted: a divisor of the 4 "
     r"devices per node"),
    (lambda: config.TrainJobConfig(schedule=config.Schedule(batch_size=24),
                                   sharding=config.Sharding(gradient_accumulation_steps=2)),
     r"TrainJobConfig\.schedule\.batch_size=24 is invalid; accepted: a multiple of the 8 "
     r"data-parallel devices of sharding\.mesh \(2, 4\) x "
     r"sharding\.gradient_accumulation_steps=2, e\.g\. 16"),
    (lambda: config.TrainJobConfig(model=config.Model(init_from="hf")),
     r"TrainJobConfig\.data\.tokenizer='char' with model\.init_from='hf' is invalid; accepted: "
     r"'pretrained'"),
    (lambda: config.TrainJobConfig(data=config.Data(tokenizer="pretrained")),
     r"TrainJobConfig\.data\.tokenizer='pretrained' with model\.init_from=None is invalid"),
    (lambda: config.Sharding(stage="3"),
     r"TrainJobConfig\.sharding\.stage='3' is invalid; accepted: an integer \(got a str\)"),
    (lambda: config.TrainJobConfig(sharding=ZeroConfig()),
     r"TrainJobConfig\.sharding=ZeroConfig\(.*\) is invalid; accepted: a Sharding"),
])
def test_the_tree_is_checked_as_a_whole_naming_the_field(build, message):
    with pytest.raises(ValueError, match=message):
        build()
