"""DeepSpeed's model-state memory estimators, transcribed, and the Llama-2-70B shape they are
compared on (`benchmarks/offload.py` prints the comparison; tests/zeroxla/analysis/
test_offload_estimate.py checks `zeroxla.estimate_memory` against them).

`deepspeed_zero2_mem_needs` and `deepspeed_zero3_mem_needs` are DeepSpeed's
`estimate_zero2_model_states_mem_needs` (deepspeed/runtime/zero/stage_1_and_2.py) and
`estimate_zero3_model_states_mem_needs` (deepspeed/runtime/zero/stage3.py), line for line: the
figures a DeepSpeed user reads before a run, so the reference is DeepSpeed's own arithmetic, not
zeroxla's.
"""

from zeroxla import models

# Llama-2-70B: GQA with 8 key/value heads, SwiGLU width 28672, untied 32000-token head.
LLAMA2_70B = models.LlamaConfig(vocab_size=32000, max_seq_len=4096, d_model=8192, num_heads=64,
                                num_kv_heads=8, num_layers=80, mlp_dim=28672)
TOTAL_PARAMS = 68_976_648_192
LARGEST_LAYER_PARAMS = 32000 * 8192          # the embedding (or the head): DeepSpeed's largest
GPUS = 8


def deepspeed_zero2_mem_needs(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                              additional_buffer_factor=1.5):
    """DeepSpeed's estimate_zero2_model_states_mem_needs -> (cpu_mem per node, gpu_mem per GPU)."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 4 * total_params + int(16 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def deepspeed_zero3_mem_needs(total_params, largest_layer_params, num_gpus_per_node=1,
                              num_nodes=1, cpu_offload=True, cpu_offload_params=True,
                              zero_init=True, additional_buffer_factor=1.5):
    """DeepSpeed's estimate_zero3_model_states_mem_needs -> (cpu_mem per node, gpu_mem per GPU,
    largest_layer_memory)."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            per_param = 18 * gpus_factor if zero_init else max(4 * num_gpus_per_node,
                                                               18 * gpus_factor)
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            per_param = 16 * gpus_factor if zero_init else max(4 * num_gpus_per_node,
                                                               16 * gpus_factor)
        cpu_mem = total_params * per_param * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        cpu_mem = (largest_layer_params if zero_init else total_params) * 4 * \
            num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory
