"""DeepSpeed compatibility: a DeepSpeed JSON config mapped onto zeroxla's dataclasses.

    config.py        load_deepspeed_config / zero_config_from_json: the loader
    overrides.py     settings given beside the JSON (a job's options) as typed overrides
    keys.py          the key table: every DeepSpeed key, its check and its destination (KEY_MAP)
    checks.py        value checks and the errors that name the JSON key
    zero_config.py   the ZeroConfig keys checked together and against the mesh (hpZ clamp)
    offload.py       offload_optimizer / offload_param (and their old spellings) onto ZeroConfig
    optimizers.py    DeepSpeed's optimizer section onto optax
    lr_schedules.py  DeepSpeed's LR schedulers (WarmupLR, WarmupDecayLR, ...) as optax schedules
    pipeline.py      the pipeline section and gradient_accumulation_steps onto a PipelineConfig
    hybrid_engine.py the hybrid_engine section onto a HybridEngineConfig

    ds = zeroxla.deepspeed.load_deepspeed_config("ds_config.json", mesh_local_size=4)
    step = zeroxla.make_step(model, mesh, optimizer=ds.optimizer, config=ds.zero)
"""

from zeroxla.deepspeed.checks import DeepSpeedConfigError, DeepSpeedConfigWarning
from zeroxla.deepspeed.config import (DeepSpeedConfig, load_deepspeed_config, read_deepspeed_json,
                                      zero_config_from_json)
from zeroxla.deepspeed.hybrid_engine import hybrid_engine_config_from_json
from zeroxla.deepspeed.keys import KEY_MAP, describe_key_map
from zeroxla.deepspeed.pipeline import pipeline_config_from_json

__all__ = ["KEY_MAP", "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedConfigWarning",
           "describe_key_map", "hybrid_engine_config_from_json", "load_deepspeed_config",
           "pipeline_config_from_json", "read_deepspeed_json", "zero_config_from_json"]
