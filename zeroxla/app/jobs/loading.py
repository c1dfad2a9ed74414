"""The models the jobs start from, loaded in one place: trained runs, Hugging Face directories,
reward models, and the LoRA adapters on them.

    open_policy       --init-from of `zeroxla dpo`: a HF causal LM or a `zeroxla train` run
    load_actor        --actor of `zeroxla ppo` / `zeroxla grpo`: a `zeroxla train` run
    load_reward       --reward: a `zeroxla reward` run or a HF reward model, for an actor
    load_reward_model a reward run (or HF reward model) as a plain RewardModel and tokenizer
    load_trained      a run's checkpoint as a plain model, a LoRA run's adapters merged
    reward_model_factory / adapted_factory   the models a job builds, adapters added
    add_adapters / check_adapters            adapters on a model, or checked abstractly
    adapters_base / recorded_base            the weights a job's adapters apply to
    check_inference_tp                       --inference-tp-size against the mesh and heads
    init_from_head / pretrained_config       a HF --init-from checked (head, vocabulary,
                                             positions) before any tensor is read
    with_adapters                            pretrained values for an adapted model

Where a job's adapters apply (`adapters_base`, `recorded_base`): the weights it started from.
`zeroxla train` records its `--init-from` (a Hugging Face directory) in its tree; `zeroxla dpo`
and `zeroxla grpo` record `BASE_KEY` in their checkpoints' metadata: their `--init-from`, or,
started from a zeroxla run (GRPO's SFT `--actor` always), that run's checkpoint step they read
merged. `zeroxla export --adapter-only` names it as the PEFT adapter's
`base_model_name_or_path`: base + adapters is the trained model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from flax import nnx

import zeroxla
from zeroxla import checkpoint, models
from zeroxla.app.run import rundir
from zeroxla.app.tokenizers.pretrained import PretrainedTokenizer
from zeroxla.app.tokenizers.records import tokenizer_from_record, tokenizes_alike
from zeroxla.checkpoint.adapters import recorded_lora
from zeroxla.lora import LoRAConfig, fuse_lora_weight
from zeroxla.models import hf as hf_io
from zeroxla.rlhf.reward_model import RewardModel, load_hf_reward_model, with_vocab_size


def add_adapters(model: Any, lora: LoRAConfig, rngs: Any) -> None:
    """`convert_linear_layer_to_lora(model, lora)` in place; a module_name the model refuses
    (matching no weight, or a shared one) is named as the option, `--lora-module-name`."""
    from zeroxla.lora import convert_linear_layer_to_lora

    try:
        convert_linear_layer_to_lora(model, lora, rngs=rngs)
    except ValueError as err:
        if str(err).startswith("LoRAConfig.module_name"):
            raise ValueError(f"--lora-module-name {lora.module_name!r}: {err}") from None
        raise


BASE_KEY = "adapters_base"      # checkpoint metadata: the weights the adapters apply to


def adapters_base(source: str | Path) -> str:
    """The absolute path of the weights a job that starts from `source` (its --init-from or
    --actor) puts its adapters on: a Hugging Face directory (holding config.json) itself; a
    zeroxla run or checkpoint directory, its newest complete step `<checkpoint>/<step>`, which
    the job reads merged (`load_trained`) and `zeroxla export` writes as a HF model."""
    from zeroxla import checkpoint
    from zeroxla.app.run import rundir

    path = Path(source).absolute()
    if (path / "config.json").is_file():
        return str(path)
    directory = rundir.checkpoint_dir_of(path)
    step = checkpoint.latest_step(directory) if directory.is_dir() else None
    return str(path if step is None else directory / str(step))


def recorded_base(meta: dict[str, Any]) -> str | None:
    """The base a checkpoint's adapters apply to (`checkpoint.read_metadata`'s JSON): the
    recorded `BASE_KEY` (dpo, grpo), else a `zeroxla train` run's --init-from; None for a
    preset's run."""
    metadata = meta.get("metadata") or {}
    if metadata.get(BASE_KEY) is not None:
        return metadata[BASE_KEY]
    return ((metadata.get("job_config") or {}).get("model") or {}).get("init_from")


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


INIT_ACCEPTED = ("a Hugging Face causal LM directory (config.json, safetensors, tokenizer) or a "
                 "`zeroxla train` run directory (or its checkpoint/)")


def open_policy(init_from: str, seq_len: int,
                lora: LoRAConfig = LoRAConfig()) -> tuple[Any, Callable[[], Any]]:
    """(tokenizer, load) of `--init-from`, a HF causal LM directory (any other head refused by
    name) or a `zeroxla train` run: everything that can be refused without the weights is
    checked here (the head, the tokenizer against the vocabulary, `seq_len` against the
    positions, `lora`'s --lora-module-name against the weights); `load()` reads the weights
    into a plain model (a LoRA run's adapters merged, `load_trained`)."""
    path = Path(init_from)
    if (path / "config.json").is_file():
        try:
            hf = hf_io.read_hf_config(path)
            hf_io.check_head(hf, (hf_io.CAUSAL_LM,), user="`zeroxla dpo`",
                             instead="DPO trains a causal LM's log-probs")
            config = hf_io.from_hf_config(hf)
        except ValueError as err:
            raise ValueError(f"--init-from {init_from}: {err}") from None
        tokenizer = PretrainedTokenizer.from_dir(path)
        tokenizer.check_vocab(config.vocab_size, f"{init_from}/config.json")
        load = lambda: hf_io.load_hf_model(path)[1]                       # noqa: E731
    else:
        directory = rundir.checkpoint_dir_of(path) if path.is_dir() else None
        if directory is None or checkpoint.latest_step(directory) is None:
            raise ValueError(f"--init-from {init_from} is neither; accepted: {INIT_ACCEPTED}")
        meta = checkpoint.read_metadata(directory)
        if meta["metadata"].get("model_kind") is not None or "tokenizer" not in meta["metadata"]:
            raise ValueError(f"--init-from {init_from}: its checkpoint is not a language "
                             f"model's with a recorded tokenizer; accepted: {INIT_ACCEPTED}")
        config = checkpoint.model_config_from_record(meta["model_config"])
        tokenizer = tokenizer_from_record(meta["metadata"]["tokenizer"])
        load = lambda: load_trained(directory)                            # noqa: E731
    limit = getattr(config, "max_seq_len", None)
    if limit is not None and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} exceeds the max_seq_len={limit} of --init-from "
                         f"{init_from}; accepted: --seq-len <= {limit}")
    check_adapters(config, lora)
    return tokenizer, load


ACTOR_ACCEPTED = ("a `zeroxla train` run directory (step 1, SFT: zeroxla train --init-from HF_DIR "
                  "--data sft.jsonl) or its checkpoint/")


def check_inference_tp(tp: int, mesh: tuple[int, int], model_config: Any,
                       model_name: str) -> None:
    """ValueError naming --inference-tp-size unless `tp` divides the mesh's devices and the
    attention heads of `model_config` (`num_heads`; `num_kv_heads`, when it has them, divides
    `tp` or `tp` divides it: the Hybrid Engine replicates the KV heads)."""
    from zeroxla.inference.layout import accepted_tp_sizes, tp_fits

    devices = mesh[0] * mesh[1]
    heads = [model_config.num_heads] if hasattr(model_config, "num_heads") else []
    kv = [model_config.num_kv_heads] if hasattr(model_config, "num_kv_heads") else []
    if tp_fits(tp, devices, heads, kv):
        return
    model = (f" and the {heads[0]} attention heads" + (f" ({kv[0]} KV heads)" if kv else "")
             + f" of {model_name}" if heads else "")
    accepted = ", ".join(map(str, accepted_tp_sizes(devices, heads, kv)))
    raise ValueError(f"--inference-tp-size {tp} does not fit the {devices} devices of --mesh "
                     f"{mesh[0]}x{mesh[1]}{model}; accepted: {accepted}")


def _checkpoint_dir(option: str, run: str | Path, accepted: str) -> Path:
    """The checkpoint directory of the run `option` names; ValueError naming it when `run` is
    not a directory or holds no complete zeroxla checkpoint (e.g. a Hugging Face directory)."""
    if not Path(run).is_dir():
        raise ValueError(f"{option} {run}: no such directory; accepted: {accepted}")
    directory = rundir.checkpoint_dir_of(run)
    if checkpoint.latest_step(directory) is None:
        raise ValueError(f"{option} {run} holds no complete zeroxla checkpoint; accepted: "
                         f"{accepted}")
    return directory


def load_actor(run: str | Path) -> tuple[Any, Any]:
    """(plain model with the trained weights, tokenizer) of a `zeroxla train` run; a LoRA
    run's adapters merged into it (`load_trained`)."""
    directory = _checkpoint_dir("--actor", run, ACTOR_ACCEPTED)
    meta = checkpoint.read_metadata(directory)["metadata"]
    if meta.get("model_kind") == REWARD_KIND:
        raise ValueError(f"--actor {run} is a reward-model run; accepted: {ACTOR_ACCEPTED}")
    if "tokenizer" not in meta:
        raise ValueError(f"--actor {run}: its checkpoint records no tokenizer; accepted: "
                         f"{ACTOR_ACCEPTED}")
    return load_trained(directory), tokenizer_from_record(meta["tokenizer"])


REWARD_ACCEPTED = ("a `zeroxla reward` run directory (step 2) or its checkpoint/, or a Hugging "
                   "Face reward model directory (*ForSequenceClassification, num_labels=1)")


def load_reward(source: str | Path, actor: Any, tokenizer: Any) -> Any:
    """The plain reward model of `--reward source` (`load_reward_model`: a `zeroxla reward` run
    or a HF reward model directory) for `actor` and its `tokenizer`: refused unless its
    tokenizer tokenizes as the actor's (`tokenizes_alike`). A vocabulary larger than the
    actor's (the pad row an exported reward model adds) is cut to the actor's ids, the only
    ones a rollout holds (`zeroxla.rlhf.with_vocab_size`: exact)."""
    if not (Path(source) / "config.json").is_file():
        _checkpoint_dir("--reward", source, REWARD_ACCEPTED)     # names the option if not a run
    try:
        reward_model, reward_tokenizer = load_reward_model(source)
    except ValueError as err:           # a HF directory of another head: say which option
        raise ValueError(f"--reward {err}") from None
    if not tokenizes_alike(tokenizer, reward_tokenizer):
        raise ValueError(f"--reward {source} tokenizes text differently from --actor's tokenizer "
                         f"({getattr(tokenizer, 'source', '') or 'recorded in its checkpoint'}); "
                         "accepted: a reward model over the actor's vocabulary (both from the "
                         "same pretrained checkpoint family)")
    vocab = actor.config.vocab_size
    if reward_model.base.config.vocab_size > vocab:
        reward_model = with_vocab_size(reward_model, vocab)
    return reward_model


REWARD_KIND = "zeroxla.rlhf.RewardModel"      # the checkpoint metadata's "model_kind"


def reward_model_factory(config: Any, seed: int = 0,
                         lora: LoRAConfig = LoRAConfig()) -> Callable[[], RewardModel]:
    """A zero-arg factory of `RewardModel(base)` for a models config (for `make_step` and
    `load_params`), with `lora`'s adapters on the base when it is enabled."""
    cls = models.model_class(config)

    def build() -> RewardModel:
        rngs = nnx.Rngs(seed)
        model = RewardModel(cls(config, rngs=rngs))
        if lora.enabled:
            add_adapters(model, lora, rngs)
        return model
    return build


def load_reward_model(run_dir: str | Path) -> tuple[RewardModel, Any]:
    """(plain RewardModel with the trained weights, a LoRA run's adapters merged, tokenizer) of
    a `zeroxla reward` run (its directory, or its checkpoint/ directory), or of a HF reward
    model directory (config.json: a `*ForSequenceClassification` with num_labels=1, and its
    tokenizer)."""
    run_dir = Path(run_dir)
    if (run_dir / "config.json").is_file():
        return load_hf_reward_model(run_dir), PretrainedTokenizer.from_dir(run_dir)
    directory = rundir.checkpoint_dir_of(run_dir)
    meta = checkpoint.read_metadata(directory)
    if meta["metadata"].get("model_kind") != REWARD_KIND:
        raise ValueError(f"{run_dir} is not a `zeroxla reward` run: its checkpoint records "
                         f"model_kind={meta['metadata'].get('model_kind')!r}, not {REWARD_KIND!r}")
    config = checkpoint.model_config_from_record(meta["model_config"])
    lora = recorded_lora(meta) or LoRAConfig()
    model = zeroxla.load_params(directory, model=reward_model_factory(config, lora=lora))
    tokenizer = tokenizer_from_record(meta["metadata"]["tokenizer"])
    return (fuse_lora_weight(model) if lora.enabled else model), tokenizer


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
    check_seq_len(seq_len, config, f"--init-from {init_from}")
    return config


def check_seq_len(seq_len: int, config: Any, source: str) -> None:
    if seq_len > config.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the max_seq_len={config.max_seq_len} of "
                         f"{source}; accepted: --seq-len <= {config.max_seq_len}")


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


__all__ = ["ACTOR_ACCEPTED", "BASE_KEY", "INIT_ACCEPTED", "REWARD_ACCEPTED", "REWARD_KIND",
           "adapted_factory", "adapters_base", "add_adapters", "check_adapters",
           "check_inference_tp", "init_from_head", "load_actor", "load_reward", "load_reward_model",
           "check_seq_len", "load_trained", "open_policy", "pretrained_config", "recorded_base",
           "reward_model_factory", "with_adapters", "INIT_FROM_HEADS"]
