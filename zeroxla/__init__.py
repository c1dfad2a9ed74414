"""zeroxla: DeepSpeed's ZeRO machinery, rebuilt natively on JAX/XLA.

    mesh = zeroxla.make_mesh(nodes=2, local=4)
    step = zeroxla.make_step(model, mesh, optimizer=optax.adamw(3e-4),
                             config=zeroxla.ZeroConfig(stage=3))
    state = step.init()
    state, metrics = step(state, batch)
"""

from zeroxla.checkpoint import (
    CheckpointError,
    Checkpointer,
    Restored,
    latest_step,
    list_checkpoints,
    load_params,
    restore,
    save,
)
from zeroxla.analysis.comm_report import CommReport, comm_report
from zeroxla.checkpoint.export import export_checkpoint
from zeroxla.checkpoint.pretrained import load_pretrained
from zeroxla.deepspeed import hybrid_engine_config_from_json, zero_config_from_json
from zeroxla.sharding.config import ZeroConfig
from zeroxla.analysis.memory import estimate_memory, memory_report
from zeroxla.sharding.mesh import make_mesh
from zeroxla.sharding.plan import ShardingPlan
from zeroxla.engine.state import TrainState, gather_params, gathered_model
from zeroxla.engine.step import ZeroStep, next_token_loss
from zeroxla.make import make_step
from zeroxla.inference import HybridEngine, HybridEngineConfig
from zeroxla.pipeline.config import PipelineConfig

__all__ = [
    "CheckpointError", "Checkpointer", "CommReport", "HybridEngine", "HybridEngineConfig", "Restored", "ShardingPlan", "TrainState", "ZeroConfig",
    "PipelineConfig", "ZeroStep", "comm_report", "estimate_memory", "export_checkpoint", "gather_params",
    "gathered_model", "hybrid_engine_config_from_json", "latest_step", "list_checkpoints", "load_params", "load_pretrained", "make_mesh", "make_step",
    "memory_report", "next_token_loss", "restore", "save", "zero_config_from_json",
]
