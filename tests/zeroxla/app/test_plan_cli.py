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
