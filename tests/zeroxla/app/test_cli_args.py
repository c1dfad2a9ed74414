"""Options shared by the `zeroxla` subcommands: the global batch against --mesh (hand-worked
divisibility, the refusal naming the options, the values and what fits), and the value types."""

import argparse
import re

import pytest

from zeroxla.app.cli_args import check_batch, mesh_shape, non_negative_float, unit_interval


def test_a_batch_the_data_parallel_devices_do_not_divide_is_refused_with_what_fits():
    check_batch(15, "--batch-size", (3, 1))
    check_batch(32, "--batch-size", (2, 4), accum=4)
    with pytest.raises(ValueError, match=re.escape(
            "--batch-size 16 is not a multiple of the 3 data-parallel devices of --mesh 3x1; "
            "use 15 (accepted: a multiple of 3, or a --mesh whose NODES x LOCAL is one of "
            "1, 2, 4, 8, 16)")):
        check_batch(16, "--batch-size", (3, 1))
    # 24 = 2 micro-batches of 12 rows: meshes of 1, 2, 3, 4, 6 or 12 devices fit.
    with pytest.raises(ValueError, match=re.escape(
            "--batch-size 24 is not a multiple of the 8 data-parallel devices of --mesh 2x4 x "
            "--grad-accum 2; use 16 (accepted: a multiple of 16, or a --mesh whose NODES x LOCAL "
            "is one of 1, 2, 3, 4, 6, 12)")):
        check_batch(24, "--batch-size", (2, 4), accum=2)
    # Fewer rows than devices: the smallest batch that fits.
    with pytest.raises(ValueError, match=r"--per-iteration-prompts 5 .* --mesh 2x4; use 8 "):
        check_batch(5, "--per-iteration-prompts", (2, 4))
    # No mesh fits a batch that the micro-batches do not divide.
    with pytest.raises(ValueError, match=r"use 4 \(accepted: a multiple of 4\)$"):
        check_batch(5, "--batch-size", (1, 2), accum=2)


def test_value_types_refuse_what_the_hyper_parameters_cannot_take():
    assert non_negative_float("0") == 0.0 and unit_interval("1") == 1.0
    assert mesh_shape("2x4") == (2, 4)
    for parse, text in ((non_negative_float, "-1e-9"), (non_negative_float, "inf"),
                        (non_negative_float, "nan"), (unit_interval, "1.5"),
                        (unit_interval, "nan"), (mesh_shape, "2x4x1"), (mesh_shape, "0x4"),
                        (mesh_shape, "x4")):
        with pytest.raises(argparse.ArgumentTypeError, match="is invalid; accepted:"):
            parse(text)
