"""The two CI legs of `.ci/run`, and the one list of what the second runs.

Leg 1 is the README's test command: the default `python3` (Python 3.11 here) with the newest JAX
its range admits there (jax 0.10), the whole suite. Leg 2 is a fresh virtualenv of Python 3.12
with the newest jax / flax / optax / orbax-checkpoint the ranges admit (jax 0.12): the daily
subset (`-m "not slow"`) plus every test, slow ones included, of the files below, the ones that
read what JAX and XLA produce and so differ by version: HLO text and collectives, memory kinds
and host offload, Pallas / Triton lowering, the jaxpr-level weight split, and checkpoints
(orbax). tests/conftest.py marks their tests `second_leg`; leg 2 runs
`pytest -m "not slow or second_leg"`. A few slow parametrizations of those files are left to leg
1 (`LEFT_TO_LEG_1`): each repeats, on another dtype, mesh or feature subset, the path a sibling
runs on leg 2, which keeps leg 2 within its 10 minutes.
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

# Slow tests of the files above that leg 2 leaves to leg 1, with the sibling that runs there.
LEFT_TO_LEG_1 = {
    "tests/zeroxla/collectives/test_zeropp.py::test_trains_like_single_device_with_the_same_rounding[qgz]":
        "[zeropp] runs qwZ, hpZ and qgZ together",
    "tests/zeroxla/collectives/test_zeropp.py::test_trains_like_single_device_with_the_same_rounding[qwz_hpz]":
        "[zeropp] runs qwZ, hpZ and qgZ together",
    "tests/zeroxla/checkpoint/test_frozen_codes.py::test_frozen_codes_restore_across_meshes_bit_for_bit[gpt-4]":
        "[gpt-8] restores the same codes across meshes",
    "tests/zeroxla/checkpoint/test_frozen_codes.py::test_save_restore_save_ten_times_keeps_the_codes[4]":
        "[8] runs the same save/restore cycle",
    "tests/zeroxla/engine/test_zero3_communication.py::test_16bit_stages_0_to_2_send_half_the_float32_bytes[0-float16]":
        "the bfloat16 case of each stage counts the same 16-bit bytes",
    "tests/zeroxla/engine/test_zero3_communication.py::test_16bit_stages_0_to_2_send_half_the_float32_bytes[1-float16]":
        "the bfloat16 case of each stage counts the same 16-bit bytes",
    "tests/zeroxla/engine/test_zero3_communication.py::test_16bit_stages_0_to_2_send_half_the_float32_bytes[2-float16]":
        "the bfloat16 case of each stage counts the same 16-bit bytes",
    "tests/zeroxla/engine/test_zero3_communication.py::test_bf16_tracks_float32_single_device[0]":
        "[2] runs the same bf16 tracking at the stage with the most collectives",
    "tests/zeroxla/engine/test_zero3_communication.py::test_bf16_tracks_float32_single_device[1]":
        "[2] runs the same bf16 tracking at the stage with the most collectives",
    "tests/zeroxla/checkpoint/test_checkpoint.py::test_restore_onto_other_devices_and_stage[2-1]":
        "[4-3] restores onto another device count and stage",
    "tests/zeroxla/engine/test_offload.py::test_zeropp_offloaded_equals_not_offloaded[offload_param]":
        "[offload_optimizer] runs ZeRO++ with the host update; test_param_offload.py covers "
        "parameter offload on leg 2",
    "tests/zeroxla/engine/test_offload.py::test_stage3_offload_keeps_a_16bit_partition_on_the_device[float16]":
        "[bfloat16] (leg 2 runs this file's slow tests too) checks the same 16-bit partitions",
}
