"""The ZeRO engine: from a model's logical axes to one compiled training step.

    mesh.py        the device mesh and the role of each axis (stage, node, local, tensor)
    config.py      ZeroConfig: how parameters, gradients and optimizer state are partitioned
    model_def.py   an nnx model's static half: parameter paths, shapes, logical axes, aliases
    model_state.py non-parameter Variables (BatchNorm statistics): replicated, cross-replica
    randomness.py  one seed -> a key per step, data device and micro-batch (dropout)
    rules.py       logical-axis rules tables: storage and compute layouts by axis name
    plan.py        the sharding plan: storage and compute layout of every parameter
    gather.py      gather before use, release, re-gather in backward (custom VJPs)
    wrap.py        the model copy inside the step: gather units follow the module tree
    loss.py        losses as (sum, count); batch_checks.py: the batch validated before sending
    optimizer.py   any optax transformation on the logical, sharded parameters
    logical.py     the state's mesh-independent form (checkpoints)
    state.py       TrainState and the consolidated (gathered) parameters
    loss_scale.py  fp16 dynamic loss scaling, DeepSpeed's semantics
    step.py        make_step: the step as one pure function, compiled once

Collectives live in `zeroxla.collectives`, kernels in `zeroxla.pallas_kernels`.
"""
