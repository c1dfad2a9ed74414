"""`zeroxla train` and `zeroxla generate` refuse bad sampling input by name: a temperature that
is not 0 or a finite positive number (nan used to emit token 0 forever and land in
summary.json), and a --tp the model's heads do not allow (listing the sizes they do)."""

import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
import xla_flags
from flax import nnx

import zeroxla
from zeroxla import models
from zeroxla.app import cli
from zeroxla.app.jobs.train import config
from zeroxla.app.sampling import check_tp, sample_tokens
from zeroxla.models import GPT, GPTConfig


@pytest.mark.parametrize("command", [["train"], ["generate", "CKPT", "--prompt", "A"]])
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "warm"])
def test_temperature_option_is_finite_and_not_negative(command, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*command, "--temperature", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (f"argument --temperature: {value!r} is invalid; accepted: 0 (greedy) or a finite "
            "positive number") in err


def test_temperature_option_accepts_zero_and_positive():
    assert cli.build_parser().parse_args(["train", "--temperature", "0"]).temperature == 0.0
    assert cli.build_parser().parse_args(
        ["generate", "C", "--prompt", "A", "--temperature", "1.5"]).temperature == 1.5


@pytest.mark.parametrize("section,field,value", [
    (config.Run, "temperature", float("nan")), (config.Run, "temperature", float("inf")),
    (config.Run, "temperature", -0.1), (config.Schedule, "lr", float("inf")),
    (config.Schedule, "weight_decay", float("nan")),
    (config.Numerics, "gradient_clipping", float("nan")),
    (config.Numerics, "gradient_clipping", float("inf"))])
def test_job_config_refuses_non_finite_numbers(section, field, value):
    with pytest.raises(ValueError, match=rf"TrainJobConfig\.{section.NAME}\.{field}={value!r} is "
                                         r"invalid; accepted: .*finite"):
        section(**{field: value})


def test_plain_sampler_refuses_nan_temperature():
    model = models.build("gpt-tiny", max_seq_len=16)
    with pytest.raises(ValueError, match=r"sample_tokens: temperature=nan is invalid; accepted: "
                                         r"0 \(greedy\) or a finite positive number"):
        sample_tokens(model, np.array([1, 2]), num_tokens=2, context=16,
                      temperature=float("nan"))


@pytest.mark.parametrize("tp,fields,devices,message", [
    (3, {"num_heads": 4}, 8, r"--tp 3 does not divide the checkpoint's model \(4 attention "
                             r"heads\) on 8 devices; accepted: 1, 2, 4$"),
    (8, {"num_heads": 4}, None, r"--tp 8 does not divide the checkpoint's model \(4 attention "
                                r"heads\); accepted: 1, 2, 4$"),
    (4, {"num_heads": 6, "num_kv_heads": 2}, None, r"\(6 attention heads, 2 KV heads\); "
                                                   r"accepted: 1, 2, 6$"),
    (3, {"num_heads": 6, "num_kv_heads": 2}, 8, r"on 8 devices; accepted: 1, 2$"),
])
def test_tp_names_the_sizes_the_heads_allow(tp, fields, devices, message):
    with pytest.raises(ValueError, match=message):
        check_tp(tp, fields, devices)
    check_tp(2, fields, devices)                 # a size that fits passes


def test_host_device_count_reads_xla_flags():
    flag = xla_flags.DEVICE_COUNT_FLAG
    assert cli.host_device_count({"XLA_FLAGS": f"--foo {flag}=6"}) == 6
    assert cli.host_device_count({"XLA_FLAGS": "--foo"}) is None
    assert cli.host_device_count({}) is None


@pytest.mark.slow   # daily: the message itself (test_tp_names_the_sizes_the_heads_allow, above)
def test_generate_tp_lists_the_sizes_the_model_allows(tmp_path):
    """In its own process, with no device count set: the command simulates --tp devices, so
    before this check a 3-way split of a 4-head model said "accepted: 1" (the 3 devices)."""
    step = zeroxla.make_step(GPT(GPTConfig.tiny(), rngs=nnx.Rngs(0)), zeroxla.make_mesh(2, 4),
                             optimizer=optax.sgd(0.1), config=zeroxla.ZeroConfig(stage=3))
    checkpoint = tmp_path / "checkpoint"
    chars = "".join(map(chr, range(65, 130)))           # the model's 65 ids
    zeroxla.save(checkpoint, step.init(), layout=step.layout,
                 metadata={"tokenizer": {"kind": "char", "chars": chars}})
    result = subprocess.run(
        [sys.executable, "-m", "zeroxla", "generate", str(checkpoint), "--prompt", "AB",
         "--tp", "3", "--max-new-tokens", "2"], env=xla_flags.child_environ(), cwd=tmp_path,
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert ("zeroxla generate: error: --tp 3 does not divide the checkpoint's model (4 "
            "attention heads); accepted: 1, 2, 4\n") in result.stderr


@pytest.mark.parametrize("text", ["0", "0.8", "1e-39", "5e-324", "1e38", "1e300", "7", "nan",
                                  "inf", "-1", "-0.0", "1e999", "warm"])
def test_train_and_generate_temperature_is_the_engines_check(text):
    """`zeroxla train`'s closing sample (the option, then the job's run section) and `zeroxla
    generate --temperature` accept exactly what the Hybrid Engine's `Sampling` accepts, as the
    same number; the tiny and huge ones included (the engine samples them as their limits)."""
    from zeroxla.inference.sampling import Sampling

    try:
        expected = Sampling(float(text)).temperature
    except ValueError:
        expected = None
    parser = cli.build_parser()
    for command in (["train"], ["generate", "C", "--prompt", "A"]):
        if expected is None:
            with pytest.raises(SystemExit):
                parser.parse_args([*command, "--temperature", text])
        else:
            assert parser.parse_args([*command, "--temperature", text]).temperature == expected
    if expected is None:
        with pytest.raises(ValueError, match=r"TrainJobConfig\.run\.temperature="):
            config.Run(temperature=float(text) if text != "warm" else text)
    else:
        assert config.Run(temperature=float(text)).temperature == expected


def test_numpy_temperature_is_a_python_float_in_the_job():
    run = config.Run(temperature=np.float32(0.5))
    assert type(run.temperature) is float and run.temperature == 0.5      # JSON-serializable
    with pytest.raises(ValueError, match=r"TrainJobConfig\.run\.temperature=True is invalid"):
        config.Run(temperature=True)


@pytest.mark.parametrize("command", [["train"], ["generate", "C", "--prompt", "A"]])
def test_temperature_help_states_the_float32_rule(command, capsys):
    from zeroxla.inference.sampling import TEMPERATURE_RULE

    with pytest.raises(SystemExit):
        cli.main([*command, "--help"])
    assert " ".join(TEMPERATURE_RULE.split()) in " ".join(capsys.readouterr().out.split())


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A GPT-tiny checkpoint (max_seq_len 128) recording a character tokenizer of its 65 ids
    (on one device: the refusals come before its weights are read)."""
    mesh = zeroxla.make_mesh(1, 1, devices=jax.devices()[:1])
    step = zeroxla.make_step(GPT(GPTConfig.tiny(), rngs=nnx.Rngs(0)), mesh,
                             optimizer=optax.sgd(0.1), config=zeroxla.ZeroConfig(stage=0))
    checkpoint = tmp_path_factory.mktemp("generate") / "checkpoint"
    chars = "".join(map(chr, range(65, 130)))
    zeroxla.save(checkpoint, step.init(), layout=step.layout,
                 metadata={"tokenizer": {"kind": "char", "chars": chars}})
    return checkpoint


@pytest.mark.parametrize("prompt, new, message", [
    ("A" * 200, "0", "--prompt's token count 200 exceeds GPTConfig.max_seq_len=128 "),
    ("A" * 200, "5", "--prompt's token count 200 exceeds GPTConfig.max_seq_len=128 "),
    ("", "4", "--prompt is empty: there is nothing to continue; accepted: a --prompt of at "
              "least one token"),
], ids=["too-long-no-new-tokens", "too-long", "empty"])
def test_generate_blames_the_prompt_for_its_length(tiny_checkpoint, prompt, new, message,
                                                    capsys):
    """A prompt longer than the model's 128 positions, or empty, is the prompt's fault
    (before: "--max-new-tokens <= 0" for the first; an internal function's name for the
    empty one): exit 2, naming --prompt, its token count and the model's max_seq_len."""
    assert cli.main(["generate", str(tiny_checkpoint), "--prompt", prompt,
                     "--max-new-tokens", new]) == 2
    err = capsys.readouterr().err
    assert f"zeroxla generate: error: {message}" in err, err
    assert "--max-new-tokens" not in err and "sample_with_engine" not in err
    if prompt:
        assert "accepted: a --prompt of at most 128 tokens" in err
