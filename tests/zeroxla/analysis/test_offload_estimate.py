"""`estimate_memory` with ZeRO-Offload for Llama-2-70B on one node of 8 devices, against
DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`,
`estimate_zero3_model_states_mem_needs`, transcribed in benchmarks/deepspeed_estimators.py from
deepspeed/runtime/zero/stage_1_and_2.py and stage3.py). Shapes only: nothing is allocated."""

import sys
from pathlib import Path

import pytest

import zeroxla

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from deepspeed_estimators import (  # noqa: E402  (benchmarks/)
    GPUS, LARGEST_LAYER_PARAMS, LLAMA2_70B, TOTAL_PARAMS, deepspeed_zero2_mem_needs,
    deepspeed_zero3_mem_needs)


def _estimate(stage):
    config = zeroxla.ZeroConfig(stage=stage, compute_dtype="bfloat16", offload_optimizer="cpu")
    return zeroxla.estimate_memory(LLAMA2_70B, zeroxla.make_mesh(1, GPUS), config)


def test_the_model_is_llama2_70b():
    estimate = zeroxla.estimate_memory(LLAMA2_70B, zeroxla.make_mesh(1, GPUS),
                                       zeroxla.ZeroConfig(stage=0))
    assert estimate.params == 4 * TOTAL_PARAMS            # float32, replicated


def test_zero2_offload_device_bytes_match_deepspeed():
    """ZeRO-2 + offload_optimizer: each device keeps the bf16 parameters (2 bytes/param), the
    host the float32 master partition and Adam's moments. Measured: 137.95 GB both."""
    _, gpu_mem = deepspeed_zero2_mem_needs(TOTAL_PARAMS, GPUS, 1, cpu_offload=True)
    estimate = _estimate(2)
    assert estimate.optimizer == 0
    assert estimate.training_state == pytest.approx(gpu_mem, rel=0.10)


def test_zero2_offload_host_bytes_are_deepspeeds_model_states_less_its_gradient_copy():
    """DeepSpeed's ZeRO-Offload host holds 16 bytes a parameter (fp32 master 4, Adam 8, fp32
    gradients 4; its 1.5 is a buffer factor, not state); here the gradients are copied to the
    host inside the step, for the update, and not kept there, so the host holds 12 per
    parameter, summed over the node."""
    cpu_mem, _, _ = deepspeed_zero3_mem_needs(TOTAL_PARAMS, LARGEST_LAYER_PARAMS, GPUS, 1,
                                              cpu_offload=True, cpu_offload_params=False)
    without_gradients = cpu_mem / 1.5 - 4 * TOTAL_PARAMS
    assert GPUS * _estimate(2).host_state == pytest.approx(without_gradients, rel=0.10)


def test_zero3_offload_device_bytes_match_deepspeed():
    """ZeRO-3 + offload_optimizer under bf16: each device keeps its bf16 parameter partition
    (2 bytes/param / N), the host the float32 master partition and Adam's moments, as DeepSpeed
    lays it out. DeepSpeed's figure adds its largest layer in float32 as a working buffer
    (1.05 GB). Measured: 17.25 GB here, 18.29 GB DeepSpeed's."""
    _, gpu_mem, _ = deepspeed_zero3_mem_needs(TOTAL_PARAMS, LARGEST_LAYER_PARAMS, GPUS, 1,
                                              cpu_offload=True, cpu_offload_params=False)
    estimate = _estimate(3)
    assert estimate.optimizer == 0
    assert estimate.training_state == pytest.approx(gpu_mem, rel=0.10)


def test_zero3_parameter_offload_host_bytes_are_deepspeeds_less_its_gradient_copy():
    """ZeRO-Infinity (offload_param and offload_optimizer to the CPU, stage 3, bf16): DeepSpeed's
    host holds 18 bytes a parameter (its 16-bit parameter partition 2, float32 master 4, Adam 8,
    float32 gradients 4; 1.5 is a buffer factor). Here the same but the gradients, which stay on
    the device: 14 a parameter, summed over the node; the device keeps only the persistent
    leaves between steps (measured: 965.7 GB on the host, 3 MB per device)."""
    cpu_mem, _, _ = deepspeed_zero3_mem_needs(TOTAL_PARAMS, LARGEST_LAYER_PARAMS, GPUS, 1,
                                              cpu_offload=True, cpu_offload_params=True)
    estimate = zeroxla.estimate_memory(
        LLAMA2_70B, zeroxla.make_mesh(1, GPUS),
        zeroxla.ZeroConfig(stage=3, compute_dtype="bfloat16", offload_optimizer="cpu",
                           offload_param="cpu"))
    assert GPUS * estimate.host_state == pytest.approx(cpu_mem / 1.5 - 4 * TOTAL_PARAMS,
                                                       rel=0.10)
    assert estimate.training_state < 1e-3 * 2 * TOTAL_PARAMS / GPUS    # persistent leaves only
