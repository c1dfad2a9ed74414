"""`zeroxla plan`'s errors name the bad option and what it accepts (no compile)."""

import argparse

import pytest

from zeroxla.app import cli
from zeroxla.app.jobs.plan import memory_size, remat_list
from zeroxla.models import presets


def _refused(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["plan", *argv])
    assert stop.value.code == 2
    return capsys.readouterr().err


def test_a_bad_mesh_is_named(capsys):
    err = _refused(["--model", "Qwen2.5-0.5B", "--mesh", "3x"], capsys)
    assert "--mesh" in err and "'3x' is invalid; accepted: NODESxLOCAL" in err


def test_a_bad_device_memory_is_named(capsys):
    err = _refused(["--model", "Qwen2.5-0.5B", "--device-memory", "80XB"], capsys)
    assert "--device-memory" in err and "'80XB' is invalid; accepted:" in err and "GiB" in err


def test_seq_len_and_max_seq_len_exclude_each_other(capsys):
    err = _refused(["--model", "Qwen2.5-0.5B", "--seq-len", "8", "--max-seq-len"], capsys)
    assert "--max-seq-len" in err and "not allowed with" in err


def test_an_unknown_preset_lists_the_accepted_ones(capsys):
    assert cli.main(["plan", "--model", "Llama-9-1T"]) == 2
    err = capsys.readouterr().err
    assert "--model 'Llama-9-1T'" in err
    assert all(name in err for name in presets.NAMES)


def test_sizes_and_policies_parse_as_documented():
    assert memory_size("80GiB") == 80 * 2**30
    assert memory_size("80GB") == 80 * 10**9
    assert memory_size("1.5 MiB") == 3 * 2**19
    for bad in ("80XB", "-1GiB", "GiB", "0GB"):
        with pytest.raises(argparse.ArgumentTypeError, match="accepted"):
            memory_size(bad)
    assert remat_list("none,full,offload") == ("none", "full", "offload")
    with pytest.raises(argparse.ArgumentTypeError, match="accepted: one or more of none, full"):
        remat_list("full,fast")


def test_a_sequence_parallel_size_that_does_not_divide_local_is_named(capsys):
    argv = ["plan", "--model", "Qwen2.5-0.5B", "--mesh", "1x8", "--sequence-parallel-size", "3"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--sequence-parallel-size 3 does not divide the 8 local devices" in err
    assert "one of 1, 2, 4, 8" in err


def test_an_unknown_sequence_parallel_strategy_is_named(capsys):
    err = _refused(["--model", "Qwen2.5-0.5B", "--sequence-parallel-strategy", "star"], capsys)
    assert "--sequence-parallel-strategy" in err and "'ulysses', 'allgather', 'ring'" in err


def test_a_bare_device_memory_number_is_refused_with_an_example(capsys):
    """`--device-memory 80` is not 80 bytes (which answered "fits: no", exit 0): a number with
    no unit is refused, naming the option and an example."""
    err = _refused(["--model", "Qwen2.5-0.5B", "--device-memory", "80"], capsys)
    assert "--device-memory" in err and "'80' is invalid; accepted:" in err, err
    assert "80GiB" in err and "unit" in err, err
    with pytest.raises(argparse.ArgumentTypeError, match="'80' is invalid"):
        memory_size("80")
    assert memory_size("80B") == 80                     # bytes, said so


@pytest.mark.parametrize("strategy,seq_len,chunks", [("ulysses", 7, 2), ("ring", 6, 4)])
def test_a_seq_len_the_sequence_devices_do_not_split_is_named(capsys, strategy, seq_len,
                                                               chunks):
    """Under --sequence-parallel-size 2 each sequence is cut into P chunks (2P for the zigzag
    strategies): a --seq-len that is not a multiple is refused before any compile, naming
    --seq-len and the multiple, not the step's `batch['inputs']`."""
    assert cli.main(["plan", "--model", "Qwen2.5-0.5B", "--mesh", "1x8", "--seq-len",
                     str(seq_len), "--sequence-parallel-size", "2",
                     "--sequence-parallel-strategy", strategy]) == 2
    err = capsys.readouterr().err
    assert f"--seq-len {seq_len} is not a multiple of {chunks}" in err, err
    assert f"accepted: a multiple of {chunks}" in err and "batch[" not in err, err


def test_a_search_granularity_the_sequence_devices_do_not_split_is_named(capsys):
    """With --max-seq-len every length tried is a multiple of --granularity: under ring's
    zigzag of 2 x P chunks, 1002 is refused before any compile, naming --granularity."""
    assert cli.main(["plan", "--model", "Qwen2.5-0.5B", "--mesh", "1x8", "--max-seq-len",
                     "--granularity", "1002", "--sequence-parallel-size", "2",
                     "--sequence-parallel-strategy", "ring"]) == 2
    err = capsys.readouterr().err
    assert "--granularity 1002 is not a multiple of 4" in err and "use 1000 or 1004" in err, err


def test_max_live_parameters_reaches_the_step(capsys):
    """--max-live-parameters is the step's ZeroConfig.max_live_parameters: below one layer of
    Qwen2.5-0.5B the step refuses to gather it, naming the field, the value and the layer's
    gathered count (its config's arithmetic: the q, k, v, o and SwiGLU matrices; biases and
    norms are under the persistence threshold, kept whole on every device, never gathered)."""
    d, kv, f = 896, 2 * 64, 4864
    layer = d * d + 2 * d * kv + d * d + 3 * d * f
    assert cli.main(["plan", "--model", "Qwen2.5-0.5B", "--seq-len", "64",
                     "--max-live-parameters", "1000"]) == 2
    err = capsys.readouterr().err
    assert "ZeroConfig.max_live_parameters=1000" in err and f"accepted: >= {layer}" in err, err
    err = _refused(["--model", "Qwen2.5-0.5B", "--max-live-parameters", "0"], capsys)
    assert "--max-live-parameters" in err and "'0'" in err, err
