"""The ZeRO engine (the step layer): from the sharding plan to one compiled training step.

    model_state.py non-parameter Variables (BatchNorm statistics): replicated, cross-replica
    randomness.py  one seed -> a key per step, data device and micro-batch (dropout)
    gather.py      gather before use, release, re-gather in backward (custom VJPs)
    wrap.py        the model copy inside the step: gather units follow the module tree
    loss.py        losses as (sum, count); batch_checks.py: the batch validated before sending
    optimizer.py   any optax transformation on the logical, sharded parameters
    logical.py     the state's mesh-independent form (checkpoints)
    state.py       TrainState and the consolidated (gathered) parameters
    loss_scale.py  fp16 dynamic loss scaling, DeepSpeed's semantics
    step.py        make_step: the step as one pure function, compiled once

The plan it runs (mesh, ZeroConfig, rules, leaf plans) is `zeroxla.sharding`; collectives live
in `zeroxla.collectives`, kernels in `zeroxla.pallas_kernels`.
"""
