"""`zeroxla ppo`: DeepSpeed-Chat's step 3 on the runs of steps 1 and 2.

    zeroxla ppo --actor runs/sft --reward runs/rm --prompts prompts.jsonl --out runs/ppo

- actor and reference: the SFT run's (`zeroxla train --init-from ... --data sft.jsonl`) final
  checkpoint; the reference stays frozen;
- reward model: a `zeroxla reward` run, or a Hugging Face reward model directory (a
  `*ForSequenceClassification` with num_labels=1 and its tokenizer: downloaded, or written by
  `zeroxla export`), with the actor's vocabulary;
- critic: starts from the reward model, as DeepSpeed-Chat's does;
- LoRA (`--lora-dim`, ...): adapters on the actor and the critic, not the reference; the
  summary's "parameters" and "memory" (per device) say what trains and what it holds;
- reward: the reward model's score of prompt + answer at the answer's last real token, plus the
  per-token KL penalty against the reference (`zeroxla.rlhf.compute_rewards`);
- rollouts: the Hybrid Engine generates from the actor's ZeRO-3 partitions;
- prompts: each line's `prompt`, tokenized with the actor's tokenizer; as DeepSpeed-Chat's
  prompt dataset does, a prompt longer than `--max-prompt-seq-len` keeps its last tokens. Our
  models take no attention mask, so a shorter prompt cannot be left-padded without changing what
  the actor sees: it is refused, naming it.

Writes metrics.jsonl (one record per iteration: reward, KL, losses, the time split),
reward_kl.png, summary.json, checkpoint/actor and checkpoint/critic (ZeRO checkpoints),
actor_hf/ (the trained actor as a Hugging Face checkpoint with its tokenizer), and
rollouts/<iteration>.npz for the first and the last iteration (`zeroxla.rlhf.Rollout.load`: the
tokens, the reward model's scores, the critic's values, ...).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import zeroxla
from zeroxla import checkpoint
from zeroxla.app import chat_data, rundir
from zeroxla.app.hf_tokenizer import save_tokenizer
from zeroxla.app.cli_args import check_batch
from zeroxla.app.distributed import job_mesh
from zeroxla.app.reward_job import KIND, load_reward_model
from zeroxla.app.tokenizer_records import tokenizer_from_record, tokenizer_record, tokenizes_alike
from zeroxla.app.train.model import load_trained
from zeroxla.app.train.report import parameter_counts
from zeroxla.checkpoint.adapters import METADATA_KEY as LORA_KEY
from zeroxla.checkpoint.adapters import as_metadata
from zeroxla.checkpoint.export import export_checkpoint
from zeroxla.lora import LoRAConfig
from zeroxla.rlhf import (PPOConfig, PPORun, Rollout, plot_records, run_ppo, time_split,
                          with_vocab_size)

PLOT_FILE = "reward_kl.png"
ACTOR_EXPORT_DIR = "actor_hf"
ACTOR_ACCEPTED = ("a `zeroxla train` run directory (step 1, SFT: zeroxla train --init-from HF_DIR "
                  "--data sft.jsonl) or its checkpoint/")
ROLLOUT_DIR = "rollouts"


@dataclasses.dataclass(frozen=True)
class PPOJobConfig:
    """Everything `zeroxla ppo` needs; `ppo` holds DeepSpeed-Chat's hyper-parameters."""

    actor: str                               # a `zeroxla train` run (SFT) or its checkpoint/
    reward: str                              # a `zeroxla reward` run (or its checkpoint/), or
                                             # a HF *ForSequenceClassification directory
    prompts: str                             # a .jsonl of {"prompt"}
    ppo: PPOConfig = PPOConfig()
    iterations: int = 10
    mesh: tuple[int, int] = (2, 4)
    inference_tp_size: int = 2
    seed: int = 0
    out_dir: str | None = None
    progress: bool = True
    lora: LoRAConfig = LoRAConfig()          # actor's and critic's adapters (dim 0: none)

    def __post_init__(self) -> None:
        if not isinstance(self.lora, LoRAConfig):
            raise TypeError(f"PPOJobConfig.lora must be a LoRAConfig, got "
                            f"{type(self.lora).__name__}")
        if not isinstance(self.ppo, PPOConfig):
            raise TypeError(f"PPOJobConfig.ppo must be a PPOConfig, got {type(self.ppo).__name__}")
        for name in ("iterations", "inference_tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PPOJobConfig.{name}={value!r} is invalid; accepted: an "
                                 "integer >= 1")
        if len(self.mesh) != 2 or not all(isinstance(n, int) and n >= 1 for n in self.mesh):
            raise ValueError(f"PPOJobConfig.mesh={self.mesh!r} is invalid; accepted: (nodes, "
                             "local) with both >= 1, e.g. (2, 4)")
        # Each rollout is one global batch of the actor's and critic's steps.
        check_batch(self.ppo.prompts_per_iteration, "--per-iteration-prompts", self.mesh)


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
    if meta.get("model_kind") == KIND:
        raise ValueError(f"--actor {run} is a reward-model run; accepted: {ACTOR_ACCEPTED}")
    if "tokenizer" not in meta:
        raise ValueError(f"--actor {run}: its checkpoint records no tokenizer; accepted: "
                         f"{ACTOR_ACCEPTED}")
    return load_trained(directory), tokenizer_from_record(meta["tokenizer"])


def _check_fit(job: PPOJobConfig, actor: Any, reward_model: Any) -> None:
    """The rollout shape against the models, before any compute: prompt + answer tokens fit
    both models' positions, and --inference-tp-size fits the mesh and the actor's heads."""
    c = job.ppo
    need = c.prompt_length + c.answer_length
    for option, path, config in (("--actor", job.actor, getattr(actor, "config", None)),
                                 ("--reward", job.reward, reward_model.base.config)):
        limit = getattr(config, "max_seq_len", None)
        if limit is not None and need > limit:
            raise ValueError(f"--max-prompt-seq-len {c.prompt_length} + --max-answer-seq-len "
                             f"{c.answer_length} = {need} tokens exceed the max_seq_len={limit} "
                             f"of {option} {path}; accepted: a sum <= {limit}")
    check_inference_tp(job.inference_tp_size, job.mesh, getattr(actor, "config", None),
                       f"--actor {job.actor}")


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


def prompt_rows(prompts: list[str], tokenizer: Any, length: int, path: str) -> np.ndarray:
    """int32[N, length]: each prompt's last `length` tokens (see the module docstring)."""
    rows = []
    for i, prompt in enumerate(prompts):
        ids = np.asarray(tokenizer.encode(prompt), np.int32)
        if len(ids) < length:
            raise chat_data.ChatDataError(
                f"{path}: prompt {i + 1} ({prompt[:30]!r}...) is {len(ids)} tokens, fewer than "
                f"--max-prompt-seq-len {length}; our models take no attention mask, so prompts "
                "are not left-padded: lower --max-prompt-seq-len or lengthen the prompt")
        rows.append(ids[-length:])
    return np.stack(rows)


def _save(out: Path, trainer: Any, tokenizer: Any, critic_config: Any,
          lora: LoRAConfig) -> dict[str, str]:
    """The actor's and critic's ZeRO checkpoints (with `lora`'s record, so that `zeroxla
    export` merges their adapters), and the actor exported to Hugging Face, merged."""
    record = {"tokenizer": tokenizer_record(tokenizer), LORA_KEY: as_metadata(lora)}
    actor = checkpoint.save(out / rundir.CHECKPOINT_DIR / "actor", trainer.actor_state,
                            layout=trainer.actor_step.layout, metadata=record)
    critic = checkpoint.save(out / rundir.CHECKPOINT_DIR / "critic", trainer.critic_state,
                             layout=trainer.critic_step.layout, model_config=critic_config,
                             metadata={"model_kind": KIND, **record})
    export = out / ACTOR_EXPORT_DIR
    export_checkpoint(out / rundir.CHECKPOINT_DIR / "actor", export)
    save_tokenizer(tokenizer, export, model_max_length=trainer.actor_step.layout.model_def
                   .abstract_module().config.max_seq_len)
    return {"actor_checkpoint": str(actor), "critic_checkpoint": str(critic),
            "actor_hf": str(export)}


def footprints(trainer: Any, rollout: Rollout) -> dict[str, dict[str, Any]]:
    """The summary's "parameters" (total and trainable elements) and "memory" (per-device bytes,
    `zeroxla.memory_report` of the step compiled for `rollout`) of the actor and the critic."""
    counts, memory = {}, {}
    for name, batch in zip(("actor", "critic"), trainer.batches(rollout)):
        step, state = getattr(trainer, f"{name}_step"), getattr(trainer, f"{name}_state")
        report = zeroxla.memory_report(step.compile(state, batch), state, layout=step.layout)
        counts[name] = parameter_counts(step.layout)
        memory[name] = {k: int(v) for k, v in report.to_dict().items()
                        if isinstance(v, (int, float))}
    return {"parameters": counts, "memory": memory}


def save_rollouts(out: Path, rollouts: list[Rollout]) -> list[str]:
    """The first and the last iteration's rollouts as `rollouts/<iteration>.npz`."""
    (out / ROLLOUT_DIR).mkdir(exist_ok=True)
    return [str(rollouts[i].save(out / ROLLOUT_DIR / f"{i}.npz"))
            for i in sorted({0, len(rollouts) - 1})]


def run(job: PPOJobConfig, *, write: Callable[[str], None] = print,
        train: Callable[..., PPORun] = run_ppo) -> dict[str, Any]:
    """Runs PPO as `job` says; returns the summary (also in summary.json). A run that fails,
    or is interrupted, removes what it wrote to its directory (`zeroxla ppo` has no --resume).

    `train` runs the iterations (`zeroxla.rlhf.run_ppo`'s signature): the one place the loaded
    actor, reward model and critic start are handed on, so a test can see what they are."""
    start = time.perf_counter()
    mesh = job_mesh(job.mesh)                # a --mesh larger than the devices is refused here
    actor, tokenizer = load_actor(job.actor)
    reward_model = load_reward(job.reward, actor, tokenizer)
    _check_fit(job, actor, reward_model)
    c = job.ppo
    rows = prompt_rows(chat_data.read_prompt_jsonl(job.prompts), tokenizer, c.prompt_length,
                       job.prompts)
    out = Path(job.out_dir) if job.out_dir else rundir.default_run_dir(
        "ppo", now=datetime.datetime.now())
    rundir.check_out_dir(out, resuming=None, resumable=False)
    write(f"zeroxla ppo: actor {job.actor}, reward model {job.reward}, {len(rows)} prompts of "
          f"{c.prompt_length} tokens, answers of up to {c.answer_length}, {job.iterations} "
          f"iterations of {c.prompts_per_iteration} rollouts, ppo_epochs {c.ppo_epochs}")
    with rundir.job_directory(out, fresh=job.out_dir is None):
        with open(out / rundir.METRICS_FILE, "w", encoding="utf-8") as f:
            def on_iteration(record: dict[str, float]) -> None:
                f.write(json.dumps(record) + "\n")
                f.flush()
                write(f"iteration {record['iteration']:>3}: reward {record['reward']:.4f}  "
                      f"KL {record['kl']:.4f}  actor loss {record['actor_loss']:.4f}  critic "
                      f"loss {record['critic_loss']:.4f}")

            result = train(c, job.iterations, actor, mesh=mesh, tokenizer=tokenizer,
                           prompt_tokens=rows, reward_model=reward_model,
                           critic_init=reward_model, inference_tp_size=job.inference_tp_size,
                           eos_id=getattr(tokenizer, "eos_id", None), seed=job.seed,
                           on_iteration=on_iteration, lora=job.lora)
        plot_records(result.records).savefig(out / PLOT_FILE, dpi=100)
        paths = _save(out, result.trainer, tokenizer, reward_model.base.config, job.lora)
        paths["rollouts"] = save_rollouts(out, result.rollouts)
        records = result.records
        summary = {"iterations": job.iterations, "first_reward": records[0]["reward"],
                   "last_reward": records[-1]["reward"], "last_kl": records[-1]["kl"],
                   "time_split": time_split(records), "wall_time_s": time.perf_counter() - start,
                   "paths": paths, "ppo": dataclasses.asdict(c),
                   "lora": dataclasses.asdict(job.lora),
                   **footprints(result.trainer, result.rollouts[-1])}
        (out / rundir.SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


__all__ = ["PPOJobConfig", "check_inference_tp", "footprints", "load_actor", "load_reward",
           "prompt_rows", "run", "save_rollouts"]
