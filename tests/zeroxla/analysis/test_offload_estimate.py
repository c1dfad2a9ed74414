"""`estimate_memory` with ZeRO-Offload for Llama-2-70B on one node of 8 devices, against
DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`,
`estimate_zero3_model_states_mem_needs`, transcribed in benchmarks/deepspeed_estimators.py from
deepspeed/runtime/zero/stage_1_and_2.py and stage3.py). Shapes only: nothing is allocated.

DeepSpeed's estimators are closed-form byte counts per parameter, and so is `estimate_memory`:
every comparison is exact, in integer bytes. Where the two count different things, the test
adds or takes off each difference by name, from the model's shape: DeepSpeed's
`additional_buffer_factor` (1.5, a margin, not state: passed as 1), its float32 working buffer
of the largest layer (a gather buffer, not state between steps), its host copy of the float32
gradients (here copied to the host inside the step and not kept), and the persistent
parameters (`stage3_param_persistence_threshold`, which DeepSpeed's estimator leaves out).
"""

import sys
from pathlib import Path

import zeroxla

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from deepspeed_estimators import (  # noqa: E402  (benchmarks/)
    GPUS, LARGEST_LAYER_PARAMS, LLAMA2_70B, TOTAL_PARAMS, deepspeed_zero2_mem_needs,
    deepspeed_zero3_mem_needs)

# Stage 3's persistent parameters: the RMSNorm scales, two a layer and the final one, [D] each
# (8,192 elements, under the default persistence_threshold of 1e5; every other parameter is
# over 5e7). They stay whole on every device, in the 16-bit compute dtype.
PERSISTENT_PARAMS = (2 * LLAMA2_70B.num_layers + 1) * LLAMA2_70B.d_model
BF16 = 2                  # bytes of the 16-bit parameter copy
FP32_GRADIENT = 4         # bytes of DeepSpeed's host copy of a float32 gradient


def _estimate(stage, **offload):
    config = zeroxla.ZeroConfig(stage=stage, compute_dtype="bfloat16", offload_optimizer="cpu",
                                **offload)
    return zeroxla.estimate_memory(LLAMA2_70B, zeroxla.make_mesh(1, GPUS), config)


def _zero3_host_state(cpu_offload_params):
    """DeepSpeed's host model states of one node, bytes: its ZeRO-3 CPU figure without the
    buffer factor, less its copy of the float32 gradients."""
    cpu_mem, _, _ = deepspeed_zero3_mem_needs(TOTAL_PARAMS, LARGEST_LAYER_PARAMS, GPUS, 1,
                                              cpu_offload=True,
                                              cpu_offload_params=cpu_offload_params,
                                              additional_buffer_factor=1)
    return cpu_mem - FP32_GRADIENT * TOTAL_PARAMS


def test_the_model_is_llama2_70b():
    estimate = zeroxla.estimate_memory(LLAMA2_70B, zeroxla.make_mesh(1, GPUS),
                                       zeroxla.ZeroConfig(stage=0))
    assert estimate.params == 4 * TOTAL_PARAMS            # float32, replicated


def test_zero2_offload_device_bytes_are_deepspeeds():
    """ZeRO-2 + offload_optimizer: each device keeps the bf16 parameters (2 bytes/param), the
    host the float32 master partition and Adam's moments: DeepSpeed's GPU figure to the byte
    (137,953,296,384 B)."""
    _, gpu_mem = deepspeed_zero2_mem_needs(TOTAL_PARAMS, GPUS, 1, cpu_offload=True)
    estimate = _estimate(2)
    assert estimate.optimizer == 0
    assert estimate.training_state == gpu_mem


def test_zero2_offload_host_bytes_are_deepspeeds_model_states_less_its_gradient_copy():
    """DeepSpeed's ZeRO-Offload host holds 16 bytes a parameter (fp32 master 4, Adam 8, fp32
    gradients 4: its ZeRO-3 figure without parameter offload, which breaks the state down;
    the ZeRO-2 estimator's CPU figure, max(4 x GPUs, 16) a parameter, does not). Here the gradients
    are copied to the host inside the step, for the update, and not kept, so the host holds 12
    a parameter, summed over the node."""
    assert GPUS * _estimate(2).host_state == _zero3_host_state(cpu_offload_params=False)


def test_zero3_offload_device_bytes_are_deepspeeds_less_its_buffer_plus_persistent_leaves():
    """ZeRO-3 + offload_optimizer under bf16: each device keeps its bf16 parameter partition
    (2 bytes/param / N), the host the float32 master partition and Adam's moments, as DeepSpeed
    lays it out. DeepSpeed's figure adds its largest layer in float32 as a working buffer
    (1.05 GB, not state between steps); the persistent leaves are whole here, not 1/N.
    Measured: 17.25 GB here, 18.29 GB DeepSpeed's."""
    _, gpu_mem, largest_layer_memory = deepspeed_zero3_mem_needs(
        TOTAL_PARAMS, LARGEST_LAYER_PARAMS, GPUS, 1, cpu_offload=True, cpu_offload_params=False)
    estimate = _estimate(3)
    assert estimate.optimizer == 0
    persistent_whole_not_partitioned = BF16 * PERSISTENT_PARAMS - BF16 * PERSISTENT_PARAMS // GPUS
    assert estimate.training_state == (gpu_mem - largest_layer_memory
                                       + persistent_whole_not_partitioned)


def test_zero3_parameter_offload_host_bytes_are_deepspeeds_less_its_gradient_copy():
    """ZeRO-Infinity (offload_param and offload_optimizer to the CPU, stage 3, bf16): DeepSpeed's
    host holds 18 bytes a parameter (its 16-bit parameter partition 2, float32 master 4, Adam 8,
    float32 gradients 4). Here the same but the gradients, which stay on the device, and the
    persistent leaves' 16-bit copies, which stay whole on every device (so they are the only
    parameters a device keeps between steps): 14 a parameter summed over the node, less 2 a
    persistent one (measured: 965.7 GB on the host, 2.6 MB per device)."""
    estimate = _estimate(3, offload_param="cpu")
    assert GPUS * estimate.host_state == (_zero3_host_state(cpu_offload_params=True)
                                          - BF16 * PERSISTENT_PARAMS)
    assert estimate.training_state == BF16 * PERSISTENT_PARAMS
