"""One step of the rollout engine as data: what `step_scheduler.StepScheduler.schedule` returns
and the compiled step (`continuous.step_function`) reads. Host side, no device work.

    plan = scheduler.schedule()          # StepPlan, frozen
    plan.groups[d].chunks                # which sequence feeds which places (`scheduler.Planned`:
                                         # its tokens, first position, page table, samplers)
    plan.groups[d].copies                # (source, destination) pages copied before the step
    plan.groups[d].samples               # the sequences drawing a token, each in its own slot
    plan.arrays, plan.rows               # the host arrays filled from them (`StepArrays`)
    plan.inputs                          # the two arrays the program takes (`pack`)
    plan.places                          # each place's index in the program (after the sort)

Shapes per data group d of D: N = `BatchShape.tokens` token places, S = `BatchShape.slots`
sampling slots, M pages per sequence. A group's places are ordered by position, longest first
(`sort_places`), each slot's `sample_at` pointing at its sequence's last place after the sort.
A sequence's sampling slot is also its recurrent-state slot (a recurrent model's, e.g. Gated
DeltaNet's: `models.recurrent_slots`): each place names its slot, `place_order` gives the places
back in chunk order (each sequence's by position, as its state must see them), and a group's
prompt forking into its answers copies its slot into theirs after the step (`fork_src` ->
`fork_dst`), so the prompt's state is computed once.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from zeroxla.inference.row_sampling import RowSampling
from zeroxla.inference.scheduler import Planned, Sequence


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """The step's fixed sizes: D data groups, N token places and S slots per group, NP pages
    of P slots per group (page 0 the null page), M pages per sequence."""

    groups: int
    tokens: int
    slots: int
    pages: int
    page_size: int
    max_pages: int


@flax.struct.dataclass
class StepArrays:
    """The host arrays of one step (`continuous` module docstring, step 1)."""

    tokens: np.ndarray          # int32 [D, N]
    positions: np.ndarray       # int32 [D, N]
    token_pages: np.ndarray     # int32 [D, N, M]
    copy_src: np.ndarray        # int32 [D, S]
    copy_dst: np.ndarray        # int32 [D, S]
    sample_at: np.ndarray       # int32 [D, S]
    key_data: np.ndarray        # uint32 [D, S, ...]: the seed's key
    prompt_hash: np.ndarray     # uint32 [D, S]: `sampling.prompt_hash` of the row's prompt
    step: np.ndarray            # int32 [D, S]
    # a recurrent model's state slots (`models.recurrent_slots`): each place's sequence slot
    # (S, the null slot, for a filler), the places in feed order (each sequence's in position
    # order), and the slot copies after the step (a group's prompt state into its answers')
    place_slots: np.ndarray     # int32 [D, N]
    place_order: np.ndarray     # int32 [D, N]
    fork_src: np.ndarray        # int32 [D, S]
    fork_dst: np.ndarray        # int32 [D, S]

    @staticmethod
    def empty(shape: BatchShape, key_shape: tuple[int, ...]) -> "StepArrays":
        """Every place a filler (token 0 at position 0 on the null page and the null slot, in
        place order), no copy, no draw."""
        arrays = StepArrays(**{
            name: np.zeros((shape.groups,) + dims, np.uint32 if name in UINT32 else np.int32)
            for name, dims in _field_shapes(shape, key_shape).items()})
        for name in ("place_slots", "fork_src", "fork_dst"):
            getattr(arrays, name)[:] = shape.slots
        arrays.place_order[:] = np.arange(shape.tokens)
        return arrays


UINT32 = ("key_data", "prompt_hash")          # the StepArrays fields that are uint32


def _field_shapes(shape: BatchShape, key_shape: tuple[int, ...]) -> dict[str, tuple]:
    """Each StepArrays field's shape past the group dim [D]."""
    n, s = shape.tokens, shape.slots
    return {"tokens": (n,), "positions": (n,), "token_pages": (n, shape.max_pages),
            "copy_src": (s,), "copy_dst": (s,), "sample_at": (s,), "key_data": (s,) + key_shape,
            "prompt_hash": (s,), "step": (s,), "place_slots": (n,), "place_order": (n,),
            "fork_src": (s,), "fork_dst": (s,)}


def filler_rows(shape: BatchShape, vocab_size: int) -> RowSampling:
    """Host sampling rows [D, S] of greedy fillers."""
    rows = RowSampling.of([None] * (shape.groups * shape.slots), vocab_size)
    return jax.tree.map(lambda x: x.reshape(shape.groups, shape.slots), rows)


ROW_INTS, ROW_FLOATS = ("greedy", "uniform", "top_k", "vocab_limit"), ("a", "b", "top_p")
ROW_FIELDS = tuple(f.name for f in dataclasses.fields(RowSampling))     # `Request.row`'s order


def pack(arrays: StepArrays, rows: RowSampling) -> tuple[np.ndarray, np.ndarray]:
    """The step's host inputs as two arrays, int32 [D, X] and float32 [D, 3S] (two transfers
    a step instead of sixteen); `unpack` inverts it inside the program."""
    d = arrays.tokens.shape[0]
    ints = [np.asarray(getattr(arrays, f.name)).reshape(d, -1).view(np.int32)
            for f in dataclasses.fields(StepArrays)]
    ints += [np.asarray(getattr(rows, name), np.int32).reshape(d, -1) for name in ROW_INTS]
    floats = [np.asarray(getattr(rows, name), np.float32).reshape(d, -1) for name in ROW_FLOATS]
    return np.concatenate(ints, axis=1), np.concatenate(floats, axis=1)


def unpack(ints: jax.Array, floats: jax.Array, shape: BatchShape,
           key_shape: tuple[int, ...]) -> tuple[StepArrays, RowSampling]:
    """`pack`'s two arrays back as the step's fields (uint32 ones bitcast back)."""
    d, at, fields = ints.shape[0], 0, {}
    for name, dims in _field_shapes(shape, key_shape).items():
        size = int(np.prod(dims))
        x = ints[:, at:at + size].reshape((d,) + dims)
        fields[name] = jax.lax.bitcast_convert_type(x, jnp.uint32) if name in UINT32 else x
        at += size
    s = shape.slots
    row = {name: ints[:, at + i * s:at + (i + 1) * s] for i, name in enumerate(ROW_INTS)}
    row.update({name: floats[:, i * s:(i + 1) * s] for i, name in enumerate(ROW_FLOATS)})
    row["greedy"], row["uniform"] = row["greedy"] != 0, row["uniform"] != 0
    return StepArrays(**fields), RowSampling(**row)


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """One data group's share of a step: its chunks in place order (before `sort_places`) and
    the page copies to run before them."""

    chunks: tuple[Planned, ...]
    copies: tuple[tuple[int, int], ...]

    @property
    def samples(self) -> tuple[Sequence, ...]:
        """The sequences drawing a token at this step, in chunk order (the order they finish)."""
        return tuple(seq for chunk in self.chunks for seq in chunk.samples)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One step: each group's plan, the host arrays filled from them and the program's packed
    inputs (`pack`)."""

    groups: tuple[GroupPlan, ...]
    arrays: StepArrays
    rows: RowSampling                      # [D, S]
    inputs: tuple[np.ndarray, np.ndarray]  # int32 [D, X], float32 [D, 3S]
    places: np.ndarray                     # int32 [D, N]: chunk place -> program place

    @staticmethod
    def build(groups: tuple[GroupPlan, ...], shape: BatchShape, key_shape: tuple[int, ...],
              rows: RowSampling) -> "StepPlan":
        """The plan of `groups`; `rows` [D, S] is filled in place at the sampling slots (a
        slot that does not sample keeps what it holds)."""
        arrays = StepArrays.empty(shape, key_shape)
        places = np.zeros((shape.groups, shape.tokens), np.int32)
        for d, group in enumerate(groups):
            if len(group.copies) > shape.slots:
                raise RuntimeError(f"{len(group.copies)} page copies in one step; at most "
                                   f"{shape.slots} (one per slot) are possible")
            for i, (src, dst) in enumerate(group.copies):
                arrays.copy_src[d, i], arrays.copy_dst[d, i] = src, dst
            forks = 0
            for chunk in group.chunks:
                a, b = chunk.start, chunk.start + chunk.count
                arrays.tokens[d, a:b] = chunk.tokens
                arrays.positions[d, a:b] = np.arange(chunk.first, chunk.first + chunk.count)
                arrays.token_pages[d, a:b, :len(chunk.table)] = chunk.table
                arrays.place_slots[d, a:b] = chunk.seq.slot
                for seq in chunk.samples:
                    fill_slot(arrays, rows, d, seq, b - 1)
                    if seq is not chunk.seq:      # an answer forked from the prompt at `b - 1`
                        arrays.fork_src[d, forks], arrays.fork_dst[d, forks] = (chunk.seq.slot,
                                                                                seq.slot)
                        forks += 1
            places[d] = sort_places(arrays, d)
            arrays.place_order[d] = places[d]     # chunk order: each sequence's by position
        return StepPlan(groups, arrays, rows, pack(arrays, rows), places)


def fill_slot(arrays: StepArrays, rows: RowSampling, d: int, seq: Sequence,
              place: int) -> None:
    """Slot `seq.slot` of group d draws from place `place` with its answer's key, its prompt's
    hash, its decode step (tokens generated so far) and its request's sampling row."""
    request = seq.request
    arrays.sample_at[d, seq.slot] = place
    arrays.key_data[d, seq.slot] = request.keys[seq.answer]
    arrays.prompt_hash[d, seq.slot] = request.prompt_hash
    arrays.step[d, seq.slot] = seq.generated
    for name, value in zip(ROW_FIELDS, request.row):
        getattr(rows, name)[d, seq.slot] = value


def sort_places(arrays: StepArrays, d: int) -> np.ndarray:
    """Group d's token places ordered by position, longest first (the sampling slots follow
    their tokens), so `paged_attention`'s chunks of neighbouring places read about what their
    own tokens need. Returns where each place went, int32 [N] (a chunk's outputs in the
    program, e.g. its routing record, are read back through it)."""
    order = np.argsort(-arrays.positions[d], kind="stable")
    for name in ("tokens", "positions", "token_pages", "place_slots"):
        getattr(arrays, name)[d] = getattr(arrays, name)[d][order]
    moved = np.argsort(order).astype(np.int32)
    arrays.sample_at[d] = moved[arrays.sample_at[d]]
    return moved


__all__ = ["BatchShape", "GroupPlan", "StepArrays", "StepPlan", "fill_slot", "filler_rows",
           "pack", "sort_places", "unpack"]
