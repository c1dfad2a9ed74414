"""The model state: a model's Variables that are not parameters (batch statistics, counters).

DeepSpeed keeps PyTorch buffers (BatchNorm's running mean and variance) replicated on every
data-parallel rank. zeroxla does the same: `TrainState.model_state` holds them as a replicated
`{path: array}`, the forward pass updates them, and the step averages float updates over the
data devices. BatchNorm itself computes its batch statistics over the *global* batch, as Flax's
cross-replica `BatchNorm(axis_name=...)` does, so training equals one device on the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx

from zeroxla.sharding.model_def import path_str


def model_state_variables(model: nnx.Module) -> dict[str, nnx.Variable]:
    """`{path: Variable}` of the model's state Variables (neither parameters nor RNG streams,
    which the step re-keys every step), in `nnx.split` order."""
    return {path_str(path): node for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Variable)
            and not isinstance(node, (nnx.Param, nnx.RngState))}


def cross_replica_batch_norm(model: nnx.Module, data_axes: Sequence[str]) -> None:
    """Makes every `nnx.BatchNorm` of `model` (a copy made inside the step) average its batch
    statistics over the mesh's data axes.

    A BatchNorm that already names an axis is refused: its statistics would be averaged over
    that axis only (or fail), not over the data-parallel devices zeroxla splits the batch over.
    """
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.BatchNorm):
            if node.axis_name is not None:
                raise ValueError(
                    f"BatchNorm at {path_str(path) or '<root>'} has axis_name="
                    f"{node.axis_name!r}; zeroxla averages batch statistics over the data "
                    f"axes {tuple(data_axes)} itself: build it with axis_name=None")
            node.axis_name = tuple(data_axes)

