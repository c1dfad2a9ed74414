"""DeepSpeed compatibility: a DeepSpeed JSON config mapped onto zeroxla's dataclasses.

    config.py        load_deepspeed_config: the JSON keys, checked, onto ZeroConfig and friends
    optimizers.py    DeepSpeed's optimizer section onto optax
    lr_schedules.py  DeepSpeed's LR schedulers (WarmupLR, WarmupDecayLR, ...) as optax schedules
"""
