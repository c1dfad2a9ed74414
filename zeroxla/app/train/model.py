"""The model a `zeroxla train` job trains: a `models/` preset, or a pretrained Hugging Face
checkpoint (`--init-from`), whose weights go straight into their ZeRO partitions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from zeroxla import models
from zeroxla.app.train.config import TrainJobConfig
from zeroxla.app.train.data import SFTData, TextData
from zeroxla.app.train.lora import add_adapters
from zeroxla.checkpoint.pretrained import spread_hf_params, stage_layers
from zeroxla.checkpoint.adapters import recorded_lora
from zeroxla.lora import LoRAConfig, fuse_lora_weight
from zeroxla.models import hf as hf_io


# The heads (`models.hf`) each command's --init-from accepts, and where a refused one goes.
INIT_FROM_HEADS = {
    "zeroxla train": ((hf_io.CAUSAL_LM,), "use `zeroxla reward --init-from` or `zeroxla ppo "
                      "--reward` for a reward model (...ForSequenceClassification)"),
    "zeroxla reward": ((hf_io.CAUSAL_LM, hf_io.SEQUENCE_CLASSIFICATION),
                       "a causal LM gets a new zero score head, a reward model keeps its own"),
}


def init_from_head(init_from: str, command: str = "zeroxla train") -> str:
    """The head (`models.hf.hf_head`) of the HF checkpoint `init_from`, refused by its
    `architectures` class, before any tensor is read, when `command` does not take it."""
    accepted, instead = INIT_FROM_HEADS[command]
    try:
        return hf_io.check_head(hf_io.read_hf_config(init_from), accepted, user=f"`{command}`",
                                instead=instead)
    except ValueError as err:
        raise ValueError(f"--init-from {init_from}: {err}") from None


def pretrained_config(init_from: str, tokenizer: Any, seq_len: int,
                      command: str = "zeroxla train") -> Any:
    """The models config of the HF checkpoint `init_from`, refused (before any compute) when
    its head is not one `command` takes (`init_from_head`), `tokenizer` produces ids beyond its
    vocabulary or `seq_len` exceeds its positions."""
    init_from_head(init_from, command)
    config = hf_io.from_hf_config(hf_io.read_hf_config(init_from))
    tokenizer.check_vocab(config.vocab_size, f"{init_from}/config.json")
    _check_seq_len(seq_len, config, f"--init-from {init_from}")
    return config


def _check_seq_len(seq_len: int, config: Any, source: str) -> None:
    if seq_len > config.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the max_seq_len={config.max_seq_len} of "
                         f"{source}; accepted: --seq-len <= {config.max_seq_len}")


def model_config(job: TrainJobConfig, data: TextData | SFTData) -> Any:
    """The models config: the pretrained checkpoint's (`init_from`), or the preset's with the
    tokenizer's vocabulary (65 characters for tiny-shakespeare, 256 bytes)."""
    init_from, seq_len = job.model.init_from, job.data.seq_len
    if init_from is not None:
        return pretrained_config(init_from, data.tokenizer, seq_len)
    _, preset = models.PRESETS[job.model.preset]
    config = preset().replace(vocab_size=data.vocab_size)
    _check_seq_len(seq_len, config, f"--model {job.model.preset}")
    return config


def model_factory(job: TrainJobConfig, config: Any) -> Callable[[], Any]:
    """The job's model; with `--lora-dim`, its adapters added (`convert_linear_layer_to_lora`,
    their A drawn after the model's own parameters from the same seed)."""
    return adapted_factory(models.model_class(config), config, job.lora.config(), job.run.seed)


def adapted_factory(cls: type, config: Any, lora: LoRAConfig, seed: int) -> Callable[[], Any]:
    """`cls(config)` seeded by `seed`, with `lora`'s adapters when it is enabled."""
    from flax import nnx

    def build() -> Any:
        rngs = nnx.Rngs(seed)
        model = cls(config, rngs=rngs)
        if lora.enabled:
            add_adapters(model, lora, rngs)
        return model
    return build


def check_adapters(config: Any, lora: LoRAConfig) -> None:
    """ValueError naming --lora-module-name when `lora`'s pattern adapts no weight of the
    models `config` builds (or a shared one), found abstractly: no weight is computed."""
    if lora.enabled:
        from flax import nnx

        nnx.eval_shape(adapted_factory(models.model_class(config), config, lora, 0))


def with_adapters(values: dict[str, Any], factory: Callable[[], Any], mesh: Any) -> dict[str, Any]:
    """Pretrained `values` ({path: array}, the plain model's paths) for the adapted model
    `factory` builds: each adapted weight's value moved to '<path>/base', and the adapters'
    initial values (A drawn, B zero) computed replicated on `mesh`; the base initialisers the
    factory also runs are dead code in that program, so XLA drops them."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    def adapters() -> dict[str, Any]:
        flat = nnx.to_flat_state(nnx.state(factory(), nnx.LoRAParam))
        return {"/".join(map(str, path)): v.get_value() for path, v in flat}

    replicated = NamedSharding(mesh, PartitionSpec())
    fresh = jax.jit(adapters, out_shardings=replicated)()
    out = dict(values)
    for path in {p.rsplit("/", 1)[0] for p in fresh}:
        out[f"{path}/base"] = out.pop(path)
    return {**out, **fresh}


def load_trained(checkpoint: Any, step: int | None = None) -> Any:
    """The trained model of a run's checkpoint (a directory, or one step in it; `step`: default
    the newest) with its float32 weights (`zeroxla.load_params`), a LoRA run's adapters merged
    (`fuse_lora_weight`): the plain model that generation and PPO's actor read."""
    import zeroxla
    from zeroxla.checkpoint.export import checkpoint_metadata

    stored = checkpoint_metadata(checkpoint, step=step)
    lora = recorded_lora(stored)
    if lora is None:
        return zeroxla.load_params(checkpoint, step=stored["step"])
    config = zeroxla.checkpoint.model_config_from_record(stored["model_config"])
    factory = adapted_factory(models.model_class(config), config, lora, 0)
    return fuse_lora_weight(zeroxla.load_params(checkpoint, step=stored["step"], model=factory))


def initial_state(job: TrainJobConfig, step: Any, config: Any, mesh: Any) -> Any:
    """A fresh run's state: the pretrained weights placed in their partitions, or a new model."""
    if job.model.init_from is None:
        return step.init()
    values = spread_hf_params(config, job.model.init_from, mesh, progress=job.run.progress,
                              dtype=np.dtype(step.layout.config.master_dtype),
                              stage_layers=stage_layers(step))
    if job.lora.enabled:
        values = with_adapters(values, model_factory(job, config), mesh)
    return step.init_from(values, job.run.seed)


__all__ = ["INIT_FROM_HEADS", "adapted_factory", "check_adapters", "init_from_head",
           "initial_state", "load_trained", "model_config", "model_factory", "pretrained_config",
           "with_adapters"]
