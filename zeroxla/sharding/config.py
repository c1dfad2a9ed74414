"""`ZeroConfig`: the one frozen dataclass that says how a model is trained.

Field names follow DeepSpeed's (`stage`, `persistence_threshold`, `hpz_partition_size`,
`quantized_weights`, ...) so that a DeepSpeed user recognises them; `zeroxla.deepspeed` maps a
DeepSpeed JSON onto this class in one place (`zeroxla.deepspeed.zero_config_from_json(path)`;
the keys are mapped in `zeroxla.deepspeed.zero_config`).

Every invariant that can be checked without a mesh is checked in `__post_init__`; the ones that
need the mesh (does `hpz_partition_size` divide the local devices?) in `validate_for_mesh`. Each
error names the field, the value and the accepted values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from zeroxla.models.sequence_parallel import STRATEGIES

# "float64" (needs `jax_enable_x64`) makes master weights, gradients, their reductions and the
# optimizer state float64 as well: a numerical-verification mode in which a ZeRO run and a
# single-device run differ by float64 round-off, not float32's (see `master_dtype`).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16", "float64")
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "offload")
QUANTIZATION_BITS = (4, 8)
# ZeRO-Offload's targets (DeepSpeed's `offload_optimizer.device` / `offload_param.device`):
# "cpu" is host memory (JAX's `pinned_host` or `unpinned_host` memory kind); "nvme" is not built.
OFFLOAD_DEVICES = ("none", "cpu")
# How attention sees whole sequences under sequence parallelism: DeepSpeed-Ulysses' head
# all-to-alls, or all-gather context parallelism (any head count); the models' own list.
SEQUENCE_PARALLEL_STRATEGIES = STRATEGIES
ZERO_STAGES = (0, 1, 2, 3)


def _fail(field: str, value: Any, accepted: str) -> None:
    raise ValueError(f"ZeroConfig.{field}={value!r} is invalid; accepted: {accepted}")


def _is_int(value: Any) -> bool:
    """An integer that is not a bool (`True` is an int to Python, not a stage to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Field -> kind, checked before any range check: a wrong type is named, not coerced.
_KINDS = {"stage": "int", "persistence_threshold": "int", "prefetch": "bool",
          "max_live_parameters": "int", "remat": "str",
          "compute_dtype": "str", "loss_scale": "number", "initial_scale_power": "int",
          "loss_scale_window": "int", "hysteresis": "int", "min_loss_scale": "number",
          "gradient_clipping": "number", "check_grad_overflow": "bool",
          "gradient_accumulation_steps": "int",
          "hpz_partition_size": "int", "quantized_weights": "bool",
          "quantized_nontrainable_weights": "bool", "quantized_gradients": "bool",
          "weight_quantization_bits": "int", "weight_quantization_group_size": "int",
          "gradient_quantization_group_size": "int", "offload_optimizer": "str",
          "offload_param": "str", "offload_pin_memory": "bool"}
_CHECKS = {"int": (_is_int, "an integer"), "bool": (lambda v: isinstance(v, bool), "True or False"),
           "str": (lambda v: isinstance(v, str), "a string"),
           "number": (_is_number, "a number")}


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """How parameters, gradients and optimizer state are partitioned, and how the step runs.

    ZeRO stages (Rajbhandari et al. 2020, §5):
      0: plain data parallel; everything replicated, gradients all-reduced.
      1: optimizer state partitioned over the data devices.
      2: gradients also reduce-scattered (`psum_scatter`) and kept partitioned.
      3: parameters also partitioned; each layer is all-gathered just before it runs, released
         after, and re-gathered in backward.
    """

    stage: int = 3
    # Parameters with fewer elements than this stay replicated (DeepSpeed's
    # `stage3_param_persistence_threshold`, default 1e5); their gradients are all-reduced.
    persistence_threshold: int = 100_000
    # Issue the gather of layer i+1 before layer i computes (DeepSpeed's prefetch), so XLA can
    # overlap communication with compute.
    prefetch: bool = True
    # At most this many gathered parameter elements live at once (DeepSpeed's
    # `stage3_max_live_parameters`, default 1e9). ZeRO-3 gathers whole layers: the layer loop
    # prefetches the next layer only while two layers fit (else it gathers just in time, one
    # layer live); a layer or module call larger than this is refused when the step is traced.
    max_live_parameters: int = 1_000_000_000
    # What a gathered unit (a layer, a module call) keeps from forward to backward
    # (`zeroxla.engine.remat`): "none" keeps its activations and re-gathers only its weights
    # (DeepSpeed's default, no recompute); "full" keeps only its inputs and recomputes it in
    # backward (about a third more FLOPs, the least activation memory); "dots_saveable" /
    # "dots_with_no_batch_dims_saveable" keep what that `jax.checkpoint` policy saves;
    # "offload" keeps what "full" keeps in host memory (`pinned_host`) instead. The
    # gathered weights are never kept. Stages 0-1 run the model under plain autodiff ("none").
    remat: str = "none"
    # Forward/backward run in this dtype; master weights and optimizer state stay float32.
    compute_dtype: str = "float32"

    # fp16 dynamic loss scaling, DeepSpeed's semantics (`fp16` section). `loss_scale=0` is dynamic;
    # any positive value is a static scale.
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0

    # Clip gradients to this global norm (over all shards); 0 disables, as in DeepSpeed.
    gradient_clipping: float = 0.0
    # Skip the update when a gradient is not finite (inf/NaN): parameters and optimizer state
    # stay bit-identical and the step's `overflow` metric is True, as fp16's loss scaler skips
    # (DeepSpeed's `bf16.check_grad_overflow`; fp16 always checks). Off by default, as in
    # DeepSpeed: a non-finite gradient then reaches the optimizer, as in plain optax.
    check_grad_overflow: bool = False
    gradient_accumulation_steps: int = 1

    # ZeRO++ (Wang et al. 2023). hpZ: secondary partition over this many devices inside a node.
    hpz_partition_size: int = 1
    # qwZ: block-quantized weight all-gather.
    quantized_weights: bool = False
    # Frozen parameters stored quantized and never re-quantized.
    quantized_nontrainable_weights: bool = False
    # qgZ: int4 hierarchical all-to-all gradient reduce-scatter.
    quantized_gradients: bool = False
    # Bits and group size for qwZ (DeepSpeed uses int8 blocks of 2048 elements by default).
    weight_quantization_bits: int = 8
    weight_quantization_group_size: int = 2048
    gradient_quantization_group_size: int = 2048

    # ZeRO-Offload (Ren et al. 2021): "cpu" keeps the optimizer state and the float32 master
    # partition in host memory between steps (`zeroxla.engine.offload`); stages 1-3.
    offload_optimizer: str = "none"
    # ZeRO-Infinity's parameter offload (stage 3): "cpu" keeps every partitioned parameter's
    # partition in host memory, fetched to the device one unit at a time just before its
    # all-gather (`zeroxla.engine.offload`).
    offload_param: str = "none"
    # DeepSpeed's `pin_memory`: offloaded optimizer state and masters in page-locked host memory
    # (`pinned_host`, fast DMA) instead of pageable memory (`unpinned_host`). DeepSpeed's default
    # is False. Offloaded parameter partitions are always pinned (`param_offload_memory_kind`).
    offload_pin_memory: bool = False

    # Sequence parallelism (DeepSpeed-Ulysses, `models.sequence_parallel`): the mesh's
    # "sequence" axis splits every sequence over its devices (`make_mesh(sequence=P)`), and ZeRO
    # partitions over data x sequence. None: whatever the mesh has; a number (DeepSpeed's
    # `sequence_parallel_size`) must equal the mesh's sequence axis (`validate_for_mesh`).
    sequence_parallel_size: int | None = None
    # "ulysses" (heads split over the sequence devices: the head count must divide by them),
    # "allgather" (keys and values all-gathered, zigzag chunks for causal balance: any heads)
    # or "ring" (the same split, keys and values passed around the devices: 1/P of them held)
    # or "usp" (the same split: Ulysses in groups as far as the heads divide, a ring across).
    sequence_parallel_strategy: str = "ulysses"

    def __post_init__(self) -> None:
        if self.sequence_parallel_strategy not in SEQUENCE_PARALLEL_STRATEGIES:
            _fail("sequence_parallel_strategy", self.sequence_parallel_strategy,
                  ", ".join(SEQUENCE_PARALLEL_STRATEGIES))
        size = self.sequence_parallel_size
        if size is not None and (not _is_int(size) or size < 1):
            _fail("sequence_parallel_size", size, "None (the mesh's 'sequence' axis) or a "
                  "positive integer equal to it")
        for field, kind in _KINDS.items():
            check, accepted = _CHECKS[kind]
            if not check(getattr(self, field)):
                _fail(field, getattr(self, field), f"{accepted} (got a "
                      f"{type(getattr(self, field)).__name__})")
        if self.stage not in ZERO_STAGES:
            _fail("stage", self.stage, "0, 1, 2 or 3")
        if not isinstance(self.persistence_threshold, int) or self.persistence_threshold < 0:
            _fail("persistence_threshold", self.persistence_threshold, "an integer >= 0")
        if self.max_live_parameters < 1:
            _fail("max_live_parameters", self.max_live_parameters, "an integer >= 1")
        if self.remat not in REMAT_POLICIES:
            _fail("remat", self.remat, ", ".join(REMAT_POLICIES))
        if self.remat != "none" and self.stage < 2:
            _fail("remat", self.remat, "'none' at stage 0-1 (the model runs under plain "
                  "autodiff; a policy applies to the gathered units of stages 2-3)")
        if self.compute_dtype not in COMPUTE_DTYPES:
            _fail("compute_dtype", self.compute_dtype, ", ".join(COMPUTE_DTYPES))
        if self.loss_scale < 0:
            _fail("loss_scale", self.loss_scale, "0 (dynamic) or a positive static scale")
        if not 0 <= self.initial_scale_power <= 64:
            _fail("initial_scale_power", self.initial_scale_power, "an integer in [0, 64]")
        if self.loss_scale_window < 1:
            _fail("loss_scale_window", self.loss_scale_window, "an integer >= 1")
        if self.hysteresis < 1:
            _fail("hysteresis", self.hysteresis, "an integer >= 1")
        if self.min_loss_scale <= 0:
            _fail("min_loss_scale", self.min_loss_scale, "a positive number")
        if self.gradient_clipping < 0:
            _fail("gradient_clipping", self.gradient_clipping, "0 (off) or a positive max norm")
        if not isinstance(self.gradient_accumulation_steps, int) or self.gradient_accumulation_steps < 1:
            _fail("gradient_accumulation_steps", self.gradient_accumulation_steps, "an integer >= 1")
        if not isinstance(self.hpz_partition_size, int) or self.hpz_partition_size < 1:
            _fail("hpz_partition_size", self.hpz_partition_size,
                  "1 (off) or a divisor of the devices per node")
        if self.weight_quantization_bits not in QUANTIZATION_BITS:
            _fail("weight_quantization_bits", self.weight_quantization_bits, "4 or 8")
        for name in ("weight_quantization_group_size", "gradient_quantization_group_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                _fail(name, value, "a positive integer")
        if self.compute_dtype == "float64" and not jax.config.jax_enable_x64:
            _fail("compute_dtype", self.compute_dtype, f"{', '.join(COMPUTE_DTYPES[:3])}; "
                  "float64 needs jax.config.update('jax_enable_x64', True) first")
        if self.compute_dtype == "float64" and self.uses_zeropp:
            _fail("compute_dtype", self.compute_dtype, "float32, bfloat16 or float16 with ZeRO++ "
                  "(its int8/int4 quantization would undo a float64 verification run)")
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name) not in OFFLOAD_DEVICES:
                _fail(name, getattr(self, name), "'none' or 'cpu' (host memory; 'nvme' is not "
                      "built: zeroxla has no NVMe swapper)")
        if self.offload_optimizer != "none" and self.stage < 1:
            _fail("offload_optimizer", self.offload_optimizer, "'none' at stage 0 (ZeRO-Offload "
                  "moves the partitioned optimizer state: use stage 1, 2 or 3)")
        if self.offload_param != "none" and self.stage != 3:
            _fail("offload_param", self.offload_param, "'none' below stage 3 (only stage 3 "
                  "partitions parameters)")
        if self.offload_pin_memory and not self.offloads:
            _fail("offload_pin_memory", self.offload_pin_memory, "False unless offload_optimizer "
                  "or offload_param is 'cpu' (nothing is offloaded to pin)")
        if self.uses_zeropp and self.stage != 3:
            _fail("stage", self.stage, "3 when ZeRO++ (hpz_partition_size > 1, quantized_weights, "
                  "quantized_gradients, quantized_nontrainable_weights) is enabled")

    # ---------------------------------------------------------------------------------------
    @property
    def dtype(self) -> jnp.dtype:
        """The compute dtype as a jnp dtype."""
        return jnp.dtype(self.compute_dtype)

    @property
    def master_dtype(self) -> jnp.dtype:
        """Master weights, gradient reductions and optimizer state: float32 (DeepSpeed's fp32
        master copy) for every compute dtype but float64, where they are float64 too."""
        return jnp.dtype(jnp.float64 if self.compute_dtype == "float64" else jnp.float32)

    @property
    def uses_zeropp(self) -> bool:
        """Any ZeRO++ feature on (they all need stage 3)."""
        return (self.hpz_partition_size > 1 or self.quantized_weights
                or self.quantized_gradients or self.quantized_nontrainable_weights)

    @property
    def offloads(self) -> bool:
        """Anything kept in host memory (ZeRO-Offload / ZeRO-Infinity)."""
        return self.offload_optimizer != "none" or self.offload_param != "none"

    @property
    def offload_memory_kind(self) -> str:
        """The JAX memory kind the offloaded optimizer state and masters live in: `pin_memory`
        -> pinned, else pageable."""
        return "pinned_host" if self.offload_pin_memory else "unpinned_host"

    @property
    def param_offload_memory_kind(self) -> str:
        """The JAX memory kind offloaded parameter partitions live in: always `pinned_host`.
        The step copies one unit's partition to the device inside its program, and a JAX program
        addresses host memory only when it is pinned (an `unpinned_host` argument is one device
        buffer to the program, so the whole partition would be copied in before the step)."""
        return "pinned_host"

    @property
    def uses_loss_scaling(self) -> bool:
        """fp16 needs loss scaling; bf16 and fp32 do not (DeepSpeed does the same)."""
        return self.compute_dtype == "float16"

    @property
    def skips_overflow(self) -> bool:
        """Whether a step whose gradients are not finite skips its update: always under fp16's
        loss scaling, else when `check_grad_overflow` asks for it."""
        return self.uses_loss_scaling or self.check_grad_overflow

    def validate_for_mesh(self, local_devices: int, data_devices: int,
                          sequence_devices: int = 1) -> None:
        """Checks the fields that depend on the mesh: `local_devices` per node (sequence
        devices included), `data_devices` total, `sequence_devices` on the sequence axis."""
        size = self.sequence_parallel_size
        if size is not None and size != sequence_devices:
            _fail("sequence_parallel_size", size, f"{sequence_devices}, the mesh's 'sequence' "
                  f"axis (build the mesh with zeroxla.make_mesh(..., sequence={size}), or leave "
                  "sequence_parallel_size=None to follow the mesh)")
        if self.hpz_partition_size > 1 and local_devices % self.hpz_partition_size:
            divisors = [d for d in range(1, local_devices + 1) if local_devices % d == 0]
            _fail("hpz_partition_size", self.hpz_partition_size,
                  f"a divisor of the {local_devices} devices per node: "
                  + ", ".join(map(str, divisors)))
        del data_devices

    def replace(self, **changes: Any) -> "ZeroConfig":
        """A copy with `changes` applied (and validated)."""
        return dataclasses.replace(self, **changes)
