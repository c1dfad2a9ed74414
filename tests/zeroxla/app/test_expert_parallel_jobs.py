"""`--expert-parallel-size EP` on every job: `--mesh NODESxLOCAL` still names every device and
the data replicas stay NODES x LOCAL / P; EP consecutive replicas of a node become an expert
group (the mesh's "expert" axis), which the engine splits MoE experts over.

References: the mesh `make_mesh(nodes, local // (P EP), expert=EP, sequence=P)` built directly,
and `zeroxla train` of a dense model on the same --mesh and batch without the option (a dense
model has no leaf to split: the expert axis is one more data axis, the same losses). That an MoE
model trains as on one device under EP is tests/zeroxla/engine/test_expert_parallel.py's.
"""

import json

import jax
import numpy as np
import pytest

from zeroxla.app import cli
from zeroxla.app.distributed import job_mesh
from zeroxla.app.jobs import dpo, grpo, ppo, reward
from zeroxla.app.jobs.train.resolve import resolve_job
from zeroxla.app.run import rundir
from zeroxla.sharding.mesh import MeshAxes, make_mesh

TINY = ["--steps", "2", "--batch-size", "4", "--seq-len", "16", "--eval-batches", "1",
        "--sample-tokens", "0", "--no-progress", "--mesh", "1x4"]


@pytest.mark.parametrize("sequence,expert,names", [
    (1, 2, ("node", "local", "expert")), (2, 2, ("node", "local", "expert", "sequence")),
    (1, 4, ("node", "local", "expert"))])
def test_job_mesh_makes_consecutive_replicas_an_expert_group(sequence, expert, names):
    mesh = job_mesh((2, 4), sequence=sequence, expert=expert)
    want = make_mesh(2, 4 // (sequence * expert), expert=expert, sequence=sequence,
                     devices=jax.devices()[:8])
    axes = MeshAxes.of(mesh)
    assert axes.names == names and mesh.shape == want.shape
    assert (np.asarray(mesh.devices) == np.asarray(want.devices)).all()
    assert (axes.replicas, axes.expert_size, axes.data_size) == (8 // sequence, expert, 8)


def test_an_expert_degree_that_does_not_divide_the_replicas_is_refused_by_option():
    with pytest.raises(ValueError, match=r"--expert-parallel-size 3 does not divide the 4 data "
                                         r"replicas per node .*accepted: one of 1, 2, 4"):
        job_mesh((2, 4), expert=3)
    with pytest.raises(ValueError, match=r"--expert-parallel-size 4 does not divide the 2 data "
                                         r"replicas per node \(the LOCAL 4 of --mesh 2x4 / "
                                         r"--sequence-parallel-size 2\); accepted: one of 1, 2"):
        resolve_job({"mesh": (2, 4), "sequence_parallel_size": 2, "expert_parallel_size": 4,
                     "batch_size": 8, "seq_len": 64})


@pytest.mark.parametrize("table,required", [
    (dpo.OPTIONS, {"init_from": "x"}), (reward.OPTIONS, {"init_from": "x", "data": "y"}),
    (ppo.OPTIONS, {"actor": "a", "reward": "r", "prompts": "p"}), (grpo.OPTIONS, {"actor": "a"}),
], ids=["dpo", "reward", "ppo", "grpo"])
def test_every_rl_job_takes_the_option_and_refuses_by_name(table, required):
    tree = table.build({"expert_parallel_size": 2}, **required)
    assert tree.sharding.expert_parallel_size == 2
    assert tree.sharding.describe().endswith(", experts split over 2 devices")
    assert MeshAxes.of(tree.sharding.job_mesh()).expert_size == 2
    with pytest.raises(ValueError, match="--expert-parallel-size 3 does not divide"):
        table.build({"expert_parallel_size": 3}, **required)


def _losses(tmp_path, name, *extra):
    out = tmp_path / name
    assert cli.main(["train", *TINY, "--out", str(out), *extra]) == 0
    records = rundir.read_metrics(out / rundir.METRICS_FILE)
    return ([r["loss"] for r in records if "loss" in r],
            json.loads((out / "summary.json").read_text()))


@pytest.mark.slow            # two in-process runs
def test_train_of_a_dense_model_at_two_expert_devices_is_train_without_them(tmp_path):
    want, _ = _losses(tmp_path, "plain")
    got, summary = _losses(tmp_path, "ep2", "--expert-parallel-size", "2")
    assert len(want) == len(got) == 2
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert summary["settings"]["expert_parallel_size"] == 2
