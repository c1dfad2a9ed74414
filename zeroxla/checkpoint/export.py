"""Export: a checkpoint's consolidated weights as Hugging Face safetensors.

    zeroxla export CHECKPOINT OUT [--dtype float32|bfloat16] [--max-shard-size 5GB] [--step N]
    export_checkpoint("runs/ckpt", "hf_out", dtype="bfloat16")
    checkpoint_metadata("runs/ckpt")["metadata"]      # what the trainer stored beside it

DeepSpeed's `zero_to_fp32.py` first loads every rank's partition into host memory. Here a
checkpoint already stores every parameter whole in its logical shape (`zeroxla.checkpoint`), so
the export streams: for each Hugging Face tensor it reads just the parameter slices that make it
(one layer of a stacked `[L, ...]` leaf), straight from tensorstore with no devices, converts
them (`models.hf` owns the name map and the reshapes), and hands the tensor to the safetensors
writer, which keeps at most one shard. Host memory stays at about one shard plus a few copies of
the largest tensor, whatever the model size. Every array's checksum is verified as it is read.

A checkpoint holds one of two models, told apart by its parameters (`checkpoint_head`): a causal
LM (`GPT2LMHeadModel` / `LlamaForCausalLM`), or a reward (or value) model,
`zeroxla.rlhf.RewardModel` as `zeroxla reward` and the PPO critic save it (`base/...` and
`v_head` [D]), written as `GPT2ForSequenceClassification` / `LlamaForSequenceClassification`
with `num_labels=1`: `score.weight` [1, D] is `v_head` (both bias-free), the base's unused LM
projection is left out. A LoRA model's checkpoint (base and adapters stored apart) is written
merged, W + (alpha / r) A @ B (`zeroxla.checkpoint.adapters`); `save_adapter` writes its adapters
alone as a PEFT adapter.
transformers' classifier reads its score at each row's last token that is not
`config.pad_token_id` (`GenericForSequenceClassification.forward`); the export sets that id to
one no real token has (`pad_token_id`, see `export_checkpoint`), so a batch without padding is
scored at its true last token, where ours is.

The `zeroxla export` subcommand is declared in `zeroxla.app.cli`; it also writes the tokenizer a
`zeroxla train` checkpoint records (`zeroxla.app.tokenizers.pretrained`), so that
`transformers.AutoTokenizer.from_pretrained(OUT)` loads next to the model. Every file written is
mode 0644.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16")
FILE_MODE = 0o644


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, step: int | None = None,
                      dtype: str = "float32", max_shard_size: int | str = "5GB",
                      pad_token_id: int | None = None,
                      token_ids: dict[str, int] | None = None) -> list[Path]:
    """Writes checkpoint `step` (default: the newest complete one) as a HF model in `out_dir`.

    `checkpoint` is a checkpoint directory (the one given to `zeroxla.save`) or one step
    directory inside it. Writes `config.json` and `model.safetensors` (or numbered shards of at
    most `max_shard_size` plus `model.safetensors.index.json`), with GPT-2 / Llama parameter
    names, as a causal LM or a sequence classifier (module docstring); returns the files
    written.

    `token_ids` ({"bos_token_id": ..., "eos_token_id": ...}: the trained tokenizer's) go into
    config.json, so that transformers' `generate` stops at the EOS the model was trained with.
    `pad_token_id` (a reward model's only) is the classifier's pad id: a token id that no real
    sequence holds (its tokenizer's pad token, or an id its tokenizer never produces); the
    default and the value `vocab_size` add one zero embedding row as that id (the vocabulary
    grows by one), for a tokenizer that uses every id. Raises ValueError when the checkpoint
    records no model config of a known family or holds neither model,
    CorruptCheckpointError when an array fails its checksum.
    """
    from zeroxla.models import hf

    if dtype not in DTYPES:
        raise ValueError(f"export: dtype={dtype!r} is invalid; accepted: {', '.join(DTYPES)}")
    arrays, config = _open(Path(checkpoint), step)
    head = _stored_head(arrays, config)

    def get(path: str, layer: int | None) -> Any:
        return arrays.read(f"params/{path}", layer)

    overrides: dict[str, Any] = dict(token_ids or {})
    if head == hf.SEQUENCE_CLASSIFICATION:
        pad = config.vocab_size if pad_token_id is None else pad_token_id
        if not (isinstance(pad, int) and 0 <= pad <= config.vocab_size):
            raise ValueError(f"export: pad_token_id={pad_token_id!r} is invalid; accepted: an id "
                             f"in [0, {config.vocab_size}] ({config.vocab_size}: a new pad row)")
        if pad == config.vocab_size:
            config, get = hf.with_vocab_size(config, get, pad + 1, head)
        overrides["pad_token_id"] = pad
    elif pad_token_id is not None:
        raise ValueError(f"export: pad_token_id={pad_token_id} is for a reward model's "
                         f"checkpoint; {arrays.info.path} holds a causal LM")
    files = hf.save_hf_model(config, get, out_dir, dtype=dtype, max_shard_size=max_shard_size,
                             head=head, **overrides)
    # safetensors creates its files owner-only (0600); an export is meant to be shared and
    # uploaded, so every file is world-readable whatever the umask.
    for path in files:
        path.chmod(FILE_MODE)
    return files


def save_adapter(checkpoint: str | Path, out_dir: str | Path, *, step: int | None = None,
                 base_model_name_or_path: str | None = None) -> list[Path]:
    """Writes the LoRA adapters of checkpoint `step` as a PEFT adapter (`adapter_config.json`,
    `adapter_model.safetensors`: `zeroxla.lora.export.save_peft_adapter`) that
    `peft.PeftModel.from_pretrained` loads onto the HF export of its base; returns the files.
    ValueError when the checkpoint holds no adapters, is not a causal LM, or is of a run whose
    base trained with the adapters (not `only_optimize_lora`: only the merged export is the
    trained model)."""
    from flax import nnx

    from zeroxla.lora import LoRAWeight, convert_linear_layer_to_lora
    from zeroxla.lora.export import save_peft_adapter
    from zeroxla.models import hf, model_class

    arrays, config = _open(Path(checkpoint), step)
    if not arrays.paths:
        raise ValueError(f"export --adapter-only: checkpoint {arrays.info.path} holds no LoRA "
                         "adapters; accepted: a checkpoint of a run with --lora-dim > 0 (export "
                         "this one without --adapter-only)")
    if _stored_head(arrays, config) != hf.CAUSAL_LM:
        raise ValueError(f"export --adapter-only: checkpoint {arrays.info.path} holds a reward "
                         "model; accepted: a causal LM's adapters (export a reward model merged)")
    if not arrays.lora.only_optimize_lora:
        # Its base moved with the adapters: PEFT's base + adapters would be the untrained base
        # plus a delta, as far from the trained model as the base itself.
        raise ValueError(f"export --adapter-only: checkpoint {arrays.info.path} is of a LoRA run "
                         "whose base weights trained too (recorded only_optimize_lora=False: "
                         "run without --only-optimize-lora), so its adapters on the base would "
                         "not give the trained model; accepted: that checkpoint exported merged "
                         "(zeroxla export without --adapter-only), or --adapter-only of a run "
                         "with --only-optimize-lora")

    def adapted() -> Any:                          # shapes only: no weight is drawn
        model = model_class(config)(config, rngs=nnx.Rngs(0))
        convert_linear_layer_to_lora(model, arrays.lora, rngs=nnx.Rngs(0))
        return model
    model = nnx.eval_shape(adapted)
    adapters = {"/".join(map(str, path)): node for path, node in nnx.iter_graph(model)
                if isinstance(node, LoRAWeight)}
    if tuple(sorted(adapters)) != arrays.paths:
        raise ValueError(f"export --adapter-only: the recorded module_name "
                         f"{arrays.lora.module_name!r} adapts {sorted(adapters)[:4]}, the "
                         f"checkpoint stores adapters for {list(arrays.paths[:4])}")
    for path, node in adapters.items():
        node.lora_a.set_value(arrays.read(f"params/{path}/lora_a"))
        node.lora_b.set_value(arrays.read(f"params/{path}/lora_b"))
    files = save_peft_adapter(model, arrays.lora, config, out_dir,
                              base_model_name_or_path=base_model_name_or_path)
    for path in files:
        path.chmod(FILE_MODE)
    return files


def checkpoint_head(checkpoint: str | Path, *, step: int | None = None) -> str:
    """Which model checkpoint `step` holds, by its parameters: `models.hf.CAUSAL_LM` or
    `SEQUENCE_CLASSIFICATION` (a reward model: `base/...` and `v_head`); ValueError for
    anything else."""
    return _stored_head(*_open(Path(checkpoint), step))


def _open(path: Path, step: int | None) -> tuple[Any, Any]:
    """(StoredArrays, the models config it records) of a checkpoint or step directory; a LoRA
    model's read merged (`zeroxla.checkpoint.adapters.MergedArrays`)."""
    from zeroxla import checkpoint as ckpt

    from zeroxla.checkpoint.adapters import MergedArrays, recorded_lora

    root, step = _resolve(path, step)
    arrays = ckpt.StoredArrays(root, step)
    record = arrays.meta["model_config"]
    if record is None:
        raise ValueError(f"checkpoint {arrays.info.path} records no model config; export needs "
                         "the model family and shape (save with model_config=...)")
    return MergedArrays(arrays, recorded_lora(arrays.meta)), ckpt.model_config_from_record(record)


def _stored_head(arrays: Any, config: Any) -> str:
    """The head whose parameters (`models.hf.param_shapes`) the checkpoint holds, all of them."""
    from zeroxla.models import hf

    missing = {}
    for head in (hf.CAUSAL_LM, hf.SEQUENCE_CLASSIFICATION):
        missing[head] = [p for p in hf.param_shapes(config, head) if f"params/{p}" not in arrays]
        if not missing[head]:
            return head
    stored = sorted(name for name in arrays.meta["arrays"] if name.startswith("params/"))
    raise ValueError(
        f"checkpoint {arrays.info.path} holds neither a {config.family} causal LM (it lacks "
        f"{missing[hf.CAUSAL_LM][:3]}) nor a reward model (base/... and v_head; it lacks "
        f"{missing[hf.SEQUENCE_CLASSIFICATION][:3]}); its parameters are {stored[:6]}...: "
        "export writes the models of zeroxla.models and zeroxla.rlhf.RewardModel")


def checkpoint_metadata(checkpoint: str | Path, *, step: int | None = None) -> dict[str, Any]:
    """The stored JSON of the checkpoint `export_checkpoint(checkpoint, step=step)` would read
    (`zeroxla.checkpoint.read_metadata`): its "step", "model_config" and the caller's
    "metadata", e.g. the tokenizer `zeroxla train` records."""
    from zeroxla import checkpoint as ckpt

    root, step = _resolve(Path(checkpoint), step)
    return ckpt.read_metadata(root, step)


def _resolve(path: Path, step: int | None) -> tuple[Path, int | None]:
    """A step directory `DIR/<n>` -> (DIR, n); a checkpoint directory -> (it, step)."""
    from zeroxla import checkpoint as ckpt

    if not path.exists():
        raise FileNotFoundError(f"export: no checkpoint at {path}")
    if (path / ckpt.META_ITEM).is_dir() and path.name.isdigit():
        if step is not None and step != int(path.name):
            raise ValueError(f"export: {path} is step {path.name}, but step={step} was asked for")
        return path.parent, int(path.name)
    return path, step


__all__ = ["DTYPES", "FILE_MODE", "checkpoint_head", "checkpoint_metadata", "export_checkpoint",
           "save_adapter"]
