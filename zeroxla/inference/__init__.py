"""Inference: generation from a training state.

    engine.py    HybridEngine: reshard ZeRO-3 storage once into tensor parallelism, KV-cached
                 decode loop compiled per (batch bucket, prompt bucket)
    baseline.py  what the engine is measured against: ZeRO-3 generation that re-gathers every
                 layer at every token, and the gathered model decoded on one device
    layout.py    the tensor-parallel layout from logical axis names (rules table)
    reshard.py   ZeRO-3 storage -> the tensor-parallel layout in one program, each device
                 receiving only its own slice
    expert_reshard.py  a state trained with expert parallelism -> the same layout, through
                 the parameters' logical values
    adapter_switch.py  the switch when only trainable leaves (LoRA adapters) changed: the
                 frozen base checked bitwise unchanged, the trainable leaves alone resharded
    decode.py    the static decode loop (prefill + while_loop) and prompt packing
    static.py    the static batching path: a compiled decode per bucket and outputs asked for
                 (drawn log-probs, an MoE model's routing record), its KV caches kept
    continuous.py  continuous batching: one compiled step over a paged KV cache, run until
                 every request is done (the default where the model takes a paged cache)
    scheduler.py which tokens of which sequences a step runs (decode first, prompt chunks,
                 admission, forks of a group's prompt, preemption)
    step_scheduler.py  the data groups' scheduler: `schedule()` returns a step's plan,
                 `update(plan, tokens, logprobs)` takes its draws back and finishes answers
    step_plan.py one step as data (chunks, page copies, samplers per group) and the host
                 arrays packed from it for the compiled step
    pages.py     the host page pool: free list, reference counts, copy-on-write
    row_sampling.py  the sampling knobs as per-row arrays (one program for mixed rows)
    sampling.py  greedy / temperature / top-k / top-p as pure functions, drawing only the
                 tokenizer's ids of a padded vocabulary (`vocab_limit`); the knobs checked
                 (any Python or NumPy scalar in range) and the temperatures float32 cannot carry
                 mapped to their limits; per-prompt keys (seed, a hash of the prompt's tokens,
                 the decode step: no dependence on neighbours)
    checks.py    what the engine refuses by name: a model without the KV-cache protocol, a
                 state of another step or one donated to the training step
    rollout_group.py  RolloutGroup: the engine on devices of its own (asynchronous RL), fed
                 by `sync(state)`: one copy of the weights across, then laid out in the group
    config.py    HybridEngineConfig: DeepSpeed's `hybrid_engine` keys (the JSON file is read by
                 zeroxla.deepspeed.hybrid_engine_config_from_json)
"""

from zeroxla.inference.config import HybridEngineConfig, hybrid_engine_config_from_section
from zeroxla.inference.baseline import SingleDeviceGenerator, Zero3Generator
from zeroxla.inference.engine import HybridEngine
from zeroxla.inference.sampling import Sampling, next_token

__all__ = ["HybridEngine", "HybridEngineConfig", "Sampling", "SingleDeviceGenerator",
           "hybrid_engine_config_from_section", "next_token", "Zero3Generator"]
