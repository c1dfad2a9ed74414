"""What the ZeRO++ quantization kernels share: the quantized-array format, tile sizes, the choice
between the Pallas kernel and the jnp path, and the in-kernel arithmetic.

Numerics follow DeepSpeed's group quantizer (`csrc/includes/quantization_utils.h`,
`quantize::Params`), which its tests check against `tests/unit/ops/quantizer/test_quantize.py`:

- symmetric:  scale = 2^bits / (2 * absmax),  q = clamp(round(x * scale), q_min, q_max)
- asymmetric: scale = 2^bits / (max - min),   offset = (max + min) / 2,
              q = clamp(round((x - offset) * scale), q_min, q_max)

with [q_min, q_max] = [-2^(bits-1), 2^(bits-1) - 1] (int8 codes; int4 codes packed two a byte)

and x ~= q / scale (+ offset). Rounding is to nearest, ties to even (CUDA `__float2int_rn`). Like
DeepSpeed we store the per-group *step* 1 / scale, so dequantization is one multiply(-add). A group
with (nearly) no range gets scale 1 (DeepSpeed: `if (max == 0) scale = 1`), so all-zero input
dequantizes to finite zeros instead of 0/0.

A group holding a NaN or +-inf gets codes 0 and a NaN step (and offset), so the whole group
dequantizes to NaN: an fp16 overflow upstream of qwZ / qgZ stays visible to the overflow check
after the collective (a NaN has no integer code, and a finite code would hide it). Finite groups
get the same codes and steps as the formulas above.

The scale spreads 2^bits, not 2^bits - 1, steps over the range: the largest value is clamped
(one step of error for that one element) and every other element gets a step 2^bits / (2^bits - 1)
finer. On Gaussian int4 groups of 1024+ elements the "(2^bits - 1) / (max - min), offset = min"
variant has 5-6% more L1 error, failing DeepSpeed's own "within 1.05x of the reference" check.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

Impl = Literal["auto", "pallas", "jnp"]
IMPLS = ("auto", "pallas", "jnp")
BITS = (4, 8)

# A group whose range (absmax, or max - min) is below this is treated as constant: its scale
# stays 1. 2^8 / 1e-30 is still a finite float32, while a subnormal range would overflow the
# scale to inf and produce 0 * inf = nan. Such a group's dequantization error is below 1e-30.
MIN_RANGE = 1e-30


def _is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("data", "scales", "offsets"),
                   meta_fields=("shape", "bits", "group_size"))
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A group-quantized array: the codes, one step (and offset) per group, and what it stood for.

    Groups are contiguous runs of `group_size` elements of each row; a row is everything after
    the leading dims `lead = data.shape[:-2]` (no leading dims for `quantize`, `[local, node]`
    for `swizzled_quantize`). Rows are padded to whole groups by repeating their last element,
    which changes no group's range.

    data:    [*lead, G, group_size // (8 // bits)] int8. int4 packs two codes per byte: byte k
             of a group holds code k in its low nibble and code k + group_size/2 in its high
             nibble (halves, not neighbours, so a kernel packs with two static slices).
    scales:  [*lead, G] float32, the dequantization step 1/scale (DeepSpeed's stored "scale");
             NaN for a group that held a NaN or +-inf.
    offsets: [*lead, G] float32 for asymmetric quantization (NaN where the step is), else None.
    shape:   the logical (dequantized) shape; shape[:len(lead)] == lead.
    """

    data: jax.Array
    scales: jax.Array
    offsets: jax.Array | None
    shape: tuple[int, ...]
    bits: int
    group_size: int

    @property
    def symmetric(self) -> bool:
        return self.offsets is None

    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(self.data.shape[:-2])

    @property
    def groups(self) -> int:
        """Groups per row (G)."""
        return self.data.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes this array takes on the wire: codes plus float32 scales (and offsets)."""
        params = self.scales.size * (1 if self.symmetric else 2)
        return self.data.size + 4 * params


@dataclasses.dataclass(frozen=True)
class QuantTiles:
    """Tile sizes of the quantization kernels.

    block_elems: input elements one program handles (block_groups * group_size, at least one
                 group). A power of two, because Triton blocks must be.
    num_warps, num_stages: Triton launch parameters.
    """

    block_elems: int = 4096
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        if not _is_power_of_two(self.block_elems):
            raise ValueError(f"QuantTiles.block_elems={self.block_elems} is not a power of two "
                             f"(Triton block shapes must be); use e.g. 2048, 4096 or 8192")
        if not _is_power_of_two(self.num_warps):
            raise ValueError(f"QuantTiles.num_warps={self.num_warps} is not a power of two; "
                             f"use 1, 2, 4 or 8")

    def target_block_groups(self, group_size: int) -> int:
        """Groups per program before fitting to the array: a power of two >= 1."""
        return max(1, self.block_elems // group_size)

    def compiler_params(self):
        # Pin the Triton backend: jax 0.10 otherwise lowers pallas_call on GPU to Mosaic GPU,
        # whose block-shape rules (warpgroup-sized tiles) these kernels are not written for.
        return plt.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


DEFAULT_TILES = QuantTiles()


def out_struct(shape: tuple[int, ...], dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """A pallas_call output type that varies over the same manual mesh axes as `like`, so the
    kernels also run inside `shard_map(..., check_vma=True)`."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def use_pallas(impl: Impl, group_size: int) -> bool:
    """"auto" runs the Pallas kernel on GPU and the jnp path elsewhere (on CPU the kernel can
    only be interpreted, and XLA's fusion of the jnp path is the fast path). On GPU, "auto"
    also takes the jnp path for group sizes the kernel cannot tile (not a power of two)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    return impl == "pallas" or (impl == "auto" and on_gpu() and _is_power_of_two(group_size))


def resolve_interpret(interpret: bool | None) -> bool:
    """Pallas kernels compile only on GPU here; everywhere else they run in interpret mode."""
    return (not on_gpu()) if interpret is None else bool(interpret)


def check_quant_args(bits: int, group_size: int, *, pallas: bool) -> None:
    """Raises a ValueError naming the bad argument."""
    if bits not in BITS:
        raise ValueError(f"bits={bits!r} is not supported; use 8 (qwZ weights) or 4 (qgZ "
                         f"gradients)")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive int")
    if bits == 4 and group_size % 2:
        raise ValueError(f"group_size={group_size} is odd, but int4 packs two codes per byte; "
                         f"use an even group_size such as {group_size + 1}")
    if pallas and not _is_power_of_two(group_size):
        raise ValueError(f"group_size={group_size} is not a power of two, which the Pallas "
                         f"kernel's Triton blocks need; use impl='jnp' or group_size="
                         f"{1 << (group_size - 1).bit_length()}")


def pad_edge(x: jax.Array, size: int, axis: int = -1) -> jax.Array:
    """Pads `axis` to `size` by repeating the last element (keeps every group's range)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, mode="edge")


def block_groups_padded(tiles: QuantTiles, group_size: int, groups: int) -> int:
    """Groups per program when the group axis may be padded: the target, capped near `groups`."""
    target = tiles.target_block_groups(group_size)
    return min(target, 1 << (groups - 1).bit_length())


def block_groups_dividing(tiles: QuantTiles, group_size: int, groups: int) -> int:
    """Groups per program when the group axis may not be padded: a power of two dividing it."""
    return min(tiles.target_block_groups(group_size), groups & -groups)


# ---- In-kernel arithmetic. Only ops the Pallas Triton lowering has rules for: no lax.round_p
# ---- (there is none), no reshapes of loaded blocks, no dynamic slicing.

def round_half_to_even(v: jax.Array) -> jax.Array:
    """`jnp.round` from floor/select, which Triton lowers (it has no round rule)."""
    down = jnp.floor(v)
    frac = v - down
    odd = down - 2.0 * jnp.floor(down * 0.5)  # 1.0 where `down` is odd
    up_on_tie = down + odd
    return jnp.where(frac > 0.5, down + 1.0, jnp.where(frac < 0.5, down, up_on_tie))


def group_params(parts: tuple[jax.Array, ...], bits: int, symmetric: bool):
    """Per-group (scale, offset, finite) over a group split into column parts, each [bg, k]
    float32.

    Returns scale [bg], offset [bg] (None when symmetric), DeepSpeed's formulas above, and
    finite [bg] bool, False where the group holds a NaN or +-inf (its scale and offset are then
    meaningless).
    """
    levels = float(2 ** bits)
    # Triton lowers max / min to maxnumf / minnumf, which drop NaN (XLA's propagate it), so a NaN
    # is counted as +inf in maxima and -inf in minima: a non-finite group then has an infinite
    # range on every backend, and a finite group's range is unchanged.
    if symmetric:
        absmax = functools.reduce(jnp.maximum, [
            jnp.max(jnp.where(jnp.isnan(p), jnp.inf, jnp.abs(p)), axis=-1) for p in parts])
        has_range = absmax > MIN_RANGE
        scale = jnp.where(has_range, levels / (2.0 * jnp.where(has_range, absmax, 1.0)), 1.0)
        return scale, None, absmax < jnp.inf
    hi = functools.reduce(jnp.maximum, [
        jnp.max(jnp.where(jnp.isnan(p), jnp.inf, p), axis=-1) for p in parts])
    lo = functools.reduce(jnp.minimum, [
        jnp.min(jnp.where(jnp.isnan(p), -jnp.inf, p), axis=-1) for p in parts])
    spread = hi - lo
    has_range = spread > MIN_RANGE
    scale = jnp.where(has_range, levels / jnp.where(has_range, spread, 1.0), 1.0)
    return scale, (hi + lo) * 0.5, (hi < jnp.inf) & (lo > -jnp.inf)


def quantize_parts(parts: tuple[jax.Array, ...], bits: int, symmetric: bool):
    """Quantizes one block of groups given as column parts ([bg, gs] for int8; the two halves
    [bg, gs/2] for int4). Returns (codes [bg, gs / (8 // bits)] int8, step [bg], offset [bg]);
    a non-finite group gets codes 0 and step (and offset) NaN."""
    scale, offset, finite = group_params(parts, bits, symmetric)
    q_min, q_max = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    codes = []
    for p in parts:
        centred = p if offset is None else p - offset[:, None]
        v = jnp.where(finite[:, None], round_half_to_even(centred * scale[:, None]), 0.0)
        codes.append(jnp.clip(v, q_min, q_max).astype(jnp.int32))
    if bits == 8:
        packed = codes[0]
    else:
        low, high = codes
        packed = jnp.bitwise_or(jnp.bitwise_and(low, 0xF), jnp.left_shift(high, 4))
    step = jnp.where(finite, 1.0 / scale, jnp.nan)
    if offset is not None:
        offset = jnp.where(finite, offset, jnp.nan)
    return packed.astype(jnp.int8), step, offset


def dequantize_parts(packed: jax.Array, step: jax.Array, offset: jax.Array | None, bits: int):
    """Inverse of `quantize_parts` for one block: packed [bg, k] int8 -> column parts float32.
    Every code is multiplied by its group's step, so a NaN step makes the whole group NaN."""
    b = packed.astype(jnp.int32)
    if bits == 8:
        codes = (b,)
    else:  # sign-extend each nibble: arithmetic shifts of the int32
        codes = (jnp.right_shift(jnp.left_shift(b, 28), 28), jnp.right_shift(b, 4))
    parts = []
    for c in codes:
        v = c.astype(jnp.float32) * step[:, None]
        parts.append(v if offset is None else v + offset[:, None])
    return tuple(parts)


def split_parts(ref, bits: int):
    """Loads a [bg, gs] block as column parts (two static half-slices for int4), float32."""
    if bits == 8:
        return (ref[...].astype(jnp.float32),)
    half = ref.shape[-1] // 2
    return (ref[:, :half].astype(jnp.float32), ref[:, half:].astype(jnp.float32))


def store_parts(ref, parts: tuple[jax.Array, ...]) -> None:
    """Stores column parts into a [bg, gs] block (the inverse of `split_parts`)."""
    if len(parts) == 1:
        ref[...] = parts[0].astype(ref.dtype)
        return
    half = ref.shape[-1] // 2
    ref[:, :half] = parts[0].astype(ref.dtype)
    ref[:, half:] = parts[1].astype(ref.dtype)
