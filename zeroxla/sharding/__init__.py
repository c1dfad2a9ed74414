"""The sharding layer: what is partitioned where, as data (no collectives, no kernels).

    mesh.py        the device mesh and the role of each axis (stage, node, local, expert,
                   sequence, tensor)
    config.py      ZeroConfig: how parameters, gradients and optimizer state are partitioned
    model_def.py   an nnx model's static half: parameter paths, shapes, logical axes, aliases
    rules.py       logical-axis rules tables: storage and compute layouts by axis name
    leaf_plan.py   one parameter's layout: padding, partition, gather unit, stored form
    stored_forms.py  the stored forms that are pytrees: master with 16-bit copy, frozen codes
    plan.py        the sharding plan: storage and compute layout of every parameter

Layer: above `zeroxla.models`, below `zeroxla.collectives` and `zeroxla.engine`
(tests/zeroxla/test_package.py holds the rules). It imports no kernels: a leaf stored as codes
names its bits and group size; the step layer quantizes (`zeroxla.engine.stored`).
"""
