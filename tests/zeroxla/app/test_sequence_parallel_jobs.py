"""`--sequence-parallel-size P` on every job and the DeepSpeed JSON's `sequence_parallel_size`
(issue 52): `--mesh NODESxLOCAL` still names every device, P splits each node's LOCAL devices
into LOCAL/P data replicas x P sequence devices (DeepSpeed's dp = world / sp).

References: `zeroxla train` on the same --mesh and global batch without sequence parallelism
(the losses of two steps), DeepSpeed's batch formula train_batch_size = micro x accumulation x
world / sp written out here, and the mesh `make_mesh(nodes, local // P, sequence=P)` built
directly. Every refusal is checked for the options (or JSON key) it names, before any device
work.
"""

import json

import jax
import numpy as np
import pytest

from zeroxla.app import cli
from zeroxla.app.cli_args import check_batch
from zeroxla.app.distributed import job_mesh
from zeroxla.app.jobs import dpo, grpo, ppo, reward
from zeroxla.app.jobs.train.resolve import resolve_job
from zeroxla.app.run import rundir
from zeroxla.deepspeed.config import DeepSpeedConfigError, load_deepspeed_config
from zeroxla.deepspeed.overrides import Overrides
from zeroxla.sharding.mesh import MeshAxes, make_mesh

TINY = ["--steps", "2", "--batch-size", "4", "--seq-len", "16", "--eval-batches", "1",
        "--sample-tokens", "0", "--no-progress", "--mesh", "1x4"]


def _losses(tmp_path, name, sequence, *extra):
    out = tmp_path / name
    assert cli.main(["train", *TINY, "--sequence-parallel-size", str(sequence),
                     "--out", str(out), *extra]) == 0
    records = rundir.read_metrics(out / rundir.METRICS_FILE)
    return ([r["loss"] for r in records if "loss" in r],
            json.loads((out / "summary.json").read_text()))


@pytest.mark.slow            # two in-process runs, ~20 s each (P = 2 equal to the bit)
@pytest.mark.parametrize("strategy", ["ulysses", "allgather", "ring"])
def test_train_at_two_sequence_devices_is_train_without_them(tmp_path, strategy):
    # Same --mesh 1x4 and global batch 4: 4 replicas of whole rows, or 2 replicas x 2 halves
    # (allgather, ring: 2 zigzag chunks of 4 tokens each).
    want, _ = _losses(tmp_path, "plain", 1)
    got, summary = _losses(tmp_path, "sp2", 2, "--sequence-parallel-strategy", strategy)
    assert len(want) == len(got) == 2
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    settings = summary["settings"]
    assert settings["sequence_parallel_size"] == 2 and settings["micro_batch_size"] == 2


def test_job_mesh_splits_each_nodes_local_devices():
    mesh = job_mesh((2, 4), sequence=2)
    axes = MeshAxes.of(mesh)
    want = make_mesh(2, 2, sequence=2, devices=jax.devices()[:8])
    assert axes.names == ("node", "local", "sequence") and mesh.shape == want.shape
    assert (np.asarray(mesh.devices) == np.asarray(want.devices)).all()
    assert (axes.replicas, axes.sequence_size, axes.data_size) == (4, 2, 8)
    with pytest.raises(ValueError, match="--sequence-parallel-size 3 does not divide the 4 "
                                         "local devices of --mesh 2x4.*one of 1, 2, 4"):
        job_mesh((2, 4), sequence=3)


# ---- refusals, in the options' words, before any device work ---------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--mesh", "1x4", "--sequence-parallel-size", "3"],
     "--sequence-parallel-size 3 does not divide the 4 local devices of --mesh 1x4 (each "
     "node's LOCAL devices are LOCAL/P data replicas x P sequence devices); accepted: "
     "--sequence-parallel-size one of 1, 2, 4"),
    (["--mesh", "1x4", "--sequence-parallel-size", "4", "--seq-len", "30"],
     "--seq-len 30 is not a multiple of --sequence-parallel-size 4 (each of the 4 sequence "
     "devices holds 1/4 of every sequence); use 28 or 32 (accepted: a multiple of 4)"),
    (["--mesh", "2x4", "--sequence-parallel-size", "2", "--batch-size", "6"],
     "--batch-size 6 is not a multiple of the 4 data replicas of --mesh 2x4 with "
     "--sequence-parallel-size 2 (2 x 4/2); use 4 (accepted: a multiple of 4, or a --mesh "
     "whose NODES x LOCAL / 2 is one of 1, 2, 3, 6)"),
    (["--mesh", "1x4", "--sequence-parallel-size", "2", "--pipeline-stages", "2"],
     "--sequence-parallel-size 2 with --pipeline-stages 2: pipeline parallelism with sequence "
     "parallelism is not built"),
], ids=["divides-local", "seq-len", "batch", "pipeline"])
def test_train_refuses_naming_the_options(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["train", "--out", str(out), "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_the_batch_divides_over_the_replicas_not_the_devices():
    # 4 rows on --mesh 1x8: refused without SP (8 devices), accepted at P = 2 (4 replicas).
    with pytest.raises(ValueError, match="not a multiple of the 8 data-parallel devices"):
        resolve_job({"mesh": (1, 8), "batch_size": 4})
    job = resolve_job({"mesh": (1, 8), "batch_size": 4, "sequence_parallel_size": 2})
    assert (job.data_parallel_size, job.micro_batch_size) == (4, 1)
    assert job.zero_config().sequence_parallel_size == 2
    check_batch(8, "--batch-size", (2, 4), accum=2, sequence=2)        # 2 x 2 replicas x 2


@pytest.mark.parametrize("table,required,rows", [
    (dpo.OPTIONS, {"init_from": "x"}, {"batch_size": 6}),
    (reward.OPTIONS, {"init_from": "x", "data": "y"}, {"batch_size": 6}),
    (ppo.OPTIONS, {"actor": "a", "reward": "r", "prompts": "p"}, {"per_iteration_prompts": 6}),
    (grpo.OPTIONS, {"actor": "a"}, {"prompts_per_iteration": 3, "num_generations": 2}),
], ids=["dpo", "reward", "ppo", "grpo"])
def test_every_rl_job_takes_the_option_and_refuses_by_name(table, required, rows):
    tree = table.build({"sequence_parallel_size": 2}, **required)
    assert tree.sharding.sequence_parallel_size == 2 and tree.sharding.mesh == (2, 4)
    with pytest.raises(ValueError, match="--sequence-parallel-size 3 does not divide the 4 "
                                         "local devices of --mesh 2x4"):
        table.build({"sequence_parallel_size": 3}, **required)
    # 6 rows: no multiple of the 4 replicas of --mesh 1x8 at P = 2 (6 of 3 at P = 4 is fine).
    with pytest.raises(ValueError, match=r"6 is not a multiple of the 4 data replicas of --mesh "
                                         r"1x8 with --sequence-parallel-size 2 \(1 x 8/2\)"):
        table.build({"mesh": (1, 8), "sequence_parallel_size": 2, **rows}, **required)
    tree = table.build({"mesh": (1, 6), "sequence_parallel_size": 2, **rows}, **required)
    assert tree.sharding.describe().endswith(", sequences split over 2 devices")
    # Their losses run on packed rows only under it: padded rows are refused naming the options.
    with pytest.raises(ValueError, match="--no-packing with --sequence-parallel-size 2"):
        table.build({"sequence_parallel_size": 2, "packing": False}, **required)
    table.build({"packing": False}, **required)


def test_reward_refuses_a_seq_len_the_degree_does_not_divide():
    with pytest.raises(ValueError, match="--seq-len 63 is not a multiple of "
                                         "--sequence-parallel-size 2"):
        reward.OPTIONS.build({"sequence_parallel_size": 2, "seq_len": 63}, init_from="x",
                             data="y")


# ---- the DeepSpeed JSON -----------------------------------------------------------------------

def test_the_json_key_sets_the_degree_and_deepspeeds_batch_arithmetic():
    micro, accum, world, sp = 2, 3, 8, 4
    ds = load_deepspeed_config({"sequence_parallel_size": sp,
                                "gradient_accumulation_steps": accum,
                                "train_micro_batch_size_per_gpu": micro},
                               world_size=world, mesh_local_size=4)
    assert ds.zero.sequence_parallel_size == sp
    dp = world // sp                                    # DeepSpeed-Ulysses' dp world
    assert (ds.data_parallel_size, ds.train_batch_size) == (dp, micro * accum * dp)
    # Without the key: the whole world is data parallel, and the degree follows the mesh.
    plain = load_deepspeed_config({"train_micro_batch_size_per_gpu": micro}, world_size=world)
    assert (plain.data_parallel_size, plain.zero.sequence_parallel_size) == (world, None)


def test_the_option_beside_a_different_json_value_is_an_error_naming_both():
    overrides = Overrides(sequence_parallel_size=4,
                          given_as={"sequence_parallel_size": "--sequence-parallel-size 4"})
    with pytest.raises(DeepSpeedConfigError, match="--sequence-parallel-size 4 conflicts with "
                                                   "sequence_parallel_size=2 in DeepSpeed config; "
                                                   "give one"):
        load_deepspeed_config({"sequence_parallel_size": 2}, overrides=overrides)
    same = load_deepspeed_config({"sequence_parallel_size": 4}, overrides=overrides)
    assert same.zero.sequence_parallel_size == 4


def test_a_json_degree_that_does_not_divide_a_node_is_refused_naming_the_key():
    with pytest.raises(DeepSpeedConfigError, match="sequence_parallel_size=3 in DeepSpeed config "
                                                   "does not divide the 4 devices per node of the "
                                                   "mesh; accepted: one of 1, 2, 4"):
        load_deepspeed_config({"sequence_parallel_size": 3}, world_size=8, mesh_local_size=4)


def test_train_with_a_json_degree_builds_its_mesh_and_batch_from_it(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"sequence_parallel_size": 2, "train_batch_size": 8,
                                "zero_optimization": {"stage": 3}}))
    job = resolve_job({"deepspeed_config": str(path), "mesh": (1, 4)})
    assert job.sharding.sequence_parallel_size == job.zero_config().sequence_parallel_size == 2
    assert (job.data_parallel_size, job.micro_batch_size) == (2, 4)
    # A JSON without the key: no sequence axis (the job's default, DeepSpeed's too).
    path.write_text(json.dumps({"train_batch_size": 8}))
    assert resolve_job({"deepspeed_config": str(path), "mesh": (1, 4)}).sharding \
        .sequence_parallel_size == 1
    # The option beside a JSON that says otherwise: refused naming both.
    path.write_text(json.dumps({"sequence_parallel_size": 2, "train_batch_size": 8}))
    with pytest.raises(DeepSpeedConfigError, match="--sequence-parallel-size 4 conflicts with "
                                                   "sequence_parallel_size=2"):
        resolve_job({"deepspeed_config": str(path), "mesh": (1, 4), "sequence_parallel_size": 4})
    # A JSON degree --seq-len does not divide: refused naming the key and the option.
    with pytest.raises(ValueError, match=f"--seq-len 31 is not a multiple of "
                                         f"sequence_parallel_size=2 in {path}"):
        resolve_job({"deepspeed_config": str(path), "mesh": (1, 4), "seq_len": 31})
