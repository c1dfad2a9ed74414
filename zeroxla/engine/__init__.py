"""The ZeRO engine: from a model's logical axes to one compiled training step.

    mesh.py        the device mesh and the role of each axis (stage, node, local, tensor)
    config.py      ZeroConfig: how parameters, gradients and optimizer state are partitioned
    model_def.py   an nnx model's static half: parameter paths, shapes, logical axes
    plan.py        the sharding plan: storage and compute layout of every parameter
    gather.py      gather before use, release, re-gather in backward (custom VJPs)
    state.py       TrainState and the consolidated (gathered) parameters
    loss_scale.py  fp16 dynamic loss scaling, DeepSpeed's semantics
    step.py        make_step: the step as one pure function, compiled once

Collectives live in `zeroxla.collectives`, kernels in `zeroxla.pallas_kernels`.
"""
