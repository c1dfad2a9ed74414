"""The two CI legs of `.ci/run`, and the one list of what the second runs.

Leg 1 is the README's test command: the default `python3` (Python 3.11 here) with the newest JAX
its range admits there (jax 0.10), the whole suite. Leg 2 is a fresh virtualenv of Python 3.12
with the newest jax / flax / optax / orbax-checkpoint the ranges admit (jax 0.12): the daily
subset (`-m "not slow"`) plus every test, slow ones included, of the files below, the ones that
read what JAX and XLA produce and so differ by version: HLO text and collectives, memory kinds
and host offload, Pallas / Triton lowering, the jaxpr-level weight split, and checkpoints
(orbax). tests/conftest.py marks their tests `second_leg`; leg 2 runs
`pytest -m "not slow or second_leg"`.
"""

MARKER = "second_leg"
MARK_EXPRESSION = f"not slow or {MARKER}"

SECOND_LEG_FILES = (
    # HLO text, collectives and bytes read from the compiled program
    "tests/zeroxla/analysis/test_hlo.py",
    "tests/zeroxla/analysis/test_comm_report.py",
    "tests/zeroxla/analysis/test_peak_vs_fsdp.py",
    "tests/zeroxla/analysis/test_memory.py",
    "tests/zeroxla/collectives/test_dot_layout.py",
    "tests/zeroxla/collectives/test_quantized_collectives.py",
    "tests/zeroxla/collectives/test_wire_backends.py",
    "tests/zeroxla/collectives/test_zeropp.py",
    "tests/zeroxla/engine/test_zero3_communication.py",
    "tests/zeroxla/pipeline/test_compiled.py",
    "tests/zeroxla/pipeline/test_sends.py",
    "tests/zeroxla/inference/test_reshard.py",
    "tests/zeroxla/inference/test_reshard_floor.py",
    # memory kinds and host offload
    "tests/zeroxla/engine/test_offload.py",
    "tests/zeroxla/engine/test_param_offload.py",
    "tests/zeroxla/engine/test_offload_wrappers.py",
    "tests/zeroxla/analysis/test_offload_estimate.py",
    # Pallas and its Triton lowering
    "tests/pallas_kernels/test_quantize.py",
    "tests/pallas_kernels/test_dequant_reduce.py",
    "tests/pallas_kernels/test_swizzle.py",
    "tests/pallas_kernels/test_triton_lowering.py",
    # the weight split (jaxpr internals)
    "tests/zeroxla/pipeline/test_weight_split.py",
    # checkpoints (orbax) and Hugging Face load / export
    "tests/zeroxla/checkpoint/test_checkpoint.py",
    "tests/zeroxla/checkpoint/test_retention.py",
    "tests/zeroxla/checkpoint/test_load_params.py",
    "tests/zeroxla/checkpoint/test_frozen_codes.py",
    "tests/zeroxla/checkpoint/test_pretrained.py",
    "tests/zeroxla/checkpoint/test_export.py",
    # ... and against the golden transformers checkpoints (tests/assets/hf), torch-free
    "tests/zeroxla/checkpoint/test_pretrained_golden.py",
    "tests/models/test_hf_golden.py",
)
