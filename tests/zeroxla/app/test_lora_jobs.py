"""LoRA in the jobs: `zeroxla train --init-from --lora-dim ... --only-optimize-lora` trains the
adapters alone (summary: trainable count, optimizer bytes = Adam's for the adapters), and
`zeroxla export` writes the run merged (transformers) or `--adapter-only` (peft onto the
--init-from checkpoint), both giving the logits of our adapted model (1e-4) built from the
checkpoint's stored arrays. Refusals name the option."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zeroxla.app.jobs import loading
from zeroxla.app import cli
from zeroxla.app.jobs.train.resolve import resolve_job
from zeroxla.lora import LoRAConfig, LoRAWeight, convert_linear_layer_to_lora

MODULES = r"blocks/layers/(wq|wv|w_down)"


def test_lora_options_fill_the_tree_and_refusals_name_the_option():
    job = resolve_job({"lora_dim": 8, "lora_alpha": 16.0, "lora_module_name": MODULES,
                       "only_optimize_lora": True})
    assert job.lora.config() == LoRAConfig(8, 16.0, MODULES, True)
    assert resolve_job({}).lora.config().enabled is False
    with pytest.raises(ValueError, match=r"TrainJobConfig\.lora\.only_optimize_lora=True needs "
                                         r"dim > 0"):
        resolve_job({"only_optimize_lora": True})
    with pytest.raises(ValueError, match=r"TrainJobConfig\.lora\.module_name='wq' needs dim > 0"):
        resolve_job({"lora_module_name": "wq"})
    with pytest.raises(ValueError, match=r"TrainJobConfig\.lora\.module_name='\(' is not a "
                                         "regular expression"):
        resolve_job({"lora_dim": 4, "lora_module_name": "("})


@pytest.mark.parametrize("command, argv", [
    ("train", ["--init-from", "BASE"]),
    ("reward", ["--init-from", "BASE", "--data", "pairs.jsonl"]),
    ("ppo", ["--actor", "runs/sft", "--reward", "runs/rm", "--prompts", "prompts.jsonl"]),
    ("dpo", ["--init-from", "BASE"]), ("grpo", ["--actor", "runs/sft"])])
def test_lora_module_name_without_dim_is_refused_on_every_job(command, argv, tmp_path, capsys):
    """Without --lora-dim no weight would get adapters and the whole model would train: the
    option is refused as --only-optimize-lora is, before anything is read or written."""
    out = tmp_path / "run"
    assert cli.main([command, *argv, "--lora-module-name", "wq", "--out", str(out)]) == 2
    assert not out.exists()
    err = capsys.readouterr().err.strip().splitlines()
    # The other jobs' rows (`run.options.LORA_OPTIONS`) name the option as typed.
    prefix = ("TrainJobConfig.lora." if command == "train"
              else "--lora-module-name wq: LoRAConfig.")
    assert err[0] == (f"zeroxla {command}: error: {prefix}module_name='wq' needs dim > 0 (with "
                      "dim=0 no weight gets adapters and every weight trains: a full "
                      "fine-tune)"), err


def _train(tmp_path, base, *extra):
    out = tmp_path / "run"
    assert cli.main(["train", "--init-from", str(base), "--lora-dim", "8", "--lora-alpha", "16",
                     "--lora-module-name", MODULES, "--steps", "3", "--batch-size", "8",
                     "--seq-len", "32", "--eval-every", "3", "--eval-batches", "1",
                     "--sample-tokens", "0", "--zero-stage", "3", "--lr", "1e-2",
                     "--warmup-steps", "0", "--out", str(out), "--no-progress", *extra]) == 0
    return out


def _ours(checkpoint, tokens, lora=LoRAConfig(8, 16.0, MODULES)):
    """Our adapted Llama with the checkpoint's stored base and adapters, and its logits."""
    from zeroxla.checkpoint import StoredArrays, model_config_from_record
    from zeroxla.models import Llama

    arrays = StoredArrays(checkpoint)
    config = model_config_from_record(arrays.meta["model_config"])
    model = Llama(config, rngs=nnx.Rngs(0))
    convert_linear_layer_to_lora(model, lora, rngs=nnx.Rngs(0))
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        variable.set_value(jnp.asarray(arrays.read("params/" + "/".join(map(str, path)))))
    return np.asarray(model(jnp.asarray(tokens, jnp.int32)))


@pytest.mark.slow
def test_train_with_lora_exports_merged_and_as_a_peft_adapter(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from zeroxla.app.tiny_checkpoints import llama_checkpoint

    base = llama_checkpoint(tmp_path / "llama")
    # Pipelined (2 stages x 1 node x 4 local, ZeRO-3 inside the stages; each stage holds one
    # layer's adapters): the plain ZeRO-3 path is the PPO test's below.
    run = _train(tmp_path, base, "--only-optimize-lora", "--pipeline-stages", "2",
                 "--mesh", "1x4", "--grad-accum", "2")
    summary = json.loads((run / "summary.json").read_text())
    # Per layer (2): wq A [64, 8] B [8, 4 x 16]; wv A [64, 8] B [8, 2 x 16]; w_down A [128, 8]
    # B [8, 64].
    adapters = 2 * (64 * 8 + 8 * 64 + 64 * 8 + 8 * 32 + 128 * 8 + 8 * 64)
    assert summary["parameters"]["trainable"] == adapters
    assert summary["parameters"]["total"] > 20 * adapters
    # Adam's mu and nu, float32: per device a stage's layer (1 of 2) partitioned over its 4
    # data devices, plus two int32 step counts (Adam's and the learning-rate schedule's).
    assert summary["memory"]["optimizer"] == 2 * 4 * adapters // 8 + 2 * 4
    assert summary["settings"]["lora_dim"] == 8 and summary["settings"]["only_optimize_lora"]
    capsys.readouterr()

    checkpoint = run / "checkpoint"
    tokens = np.random.default_rng(0).integers(0, 500, (2, 11))
    ours = _ours(checkpoint, tokens)

    def logits(model):
        with torch.no_grad():
            return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()

    assert cli.main(["export", str(checkpoint), str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(logits(merged), ours, rtol=1e-4, atol=1e-4)
    capsys.readouterr()

    assert cli.main(["export", str(checkpoint), str(tmp_path / "adapter"), "--adapter-only"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert report["base_model_name_or_path"] == str(base.absolute())
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    assert np.abs(logits(hf_base) - ours).max() > 1e-3        # the adapters were trained
    adapted = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    np.testing.assert_allclose(logits(adapted), ours, rtol=1e-4, atol=1e-4)

    # `zeroxla generate` reads the run merged: greedy, its tokens are the merged export's.
    from zeroxla.app.tokenizers.pretrained import PretrainedTokenizer

    tokenizer = PretrainedTokenizer.from_dir(base)
    prompt = "ROMEO: What"
    ids = torch.as_tensor([tokenizer.encode(prompt)], dtype=torch.long)
    with torch.no_grad():
        hf_ids = merged.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, ids.shape[1]:].tolist()
    capsys.readouterr()
    assert cli.main(["generate", str(checkpoint), "--prompt", prompt, "--max-new-tokens", "6",
                     "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip() == (prompt + tokenizer.decode(hf_ids)).strip()

    # A run without LoRA has no adapter to export alone.
    plain = tmp_path / "plain"
    assert cli.main(["train", "--init-from", str(base), "--steps", "1", "--batch-size", "8",
                     "--seq-len", "32", "--eval-batches", "1", "--sample-tokens", "0",
                     "--out", str(plain), "--no-progress"]) == 0
    with pytest.raises(ValueError, match=r"export --adapter-only: checkpoint .* holds no LoRA "
                                         r"adapters; accepted: a checkpoint of a run with "
                                         r"--lora-dim > 0"):
        cli.export_adapter(str(plain / "checkpoint"), str(tmp_path / "none"))


def test_module_name_matching_nothing_is_refused_naming_the_option():
    from zeroxla.app.jobs.loading import adapted_factory
    from zeroxla.models import Llama, LlamaConfig

    build = adapted_factory(Llama, LlamaConfig.tiny(), LoRAConfig(4, module_name="blocks/nope"), 0)
    with pytest.raises(ValueError, match=r"--lora-module-name 'blocks/nope': LoRAConfig\.module_"
                                         r"name='blocks/nope' matches none of the linear weights "
                                         r"\['blocks/layers/"):
        build()
    plain = adapted_factory(Llama, LlamaConfig.tiny(), LoRAConfig(), 0)()
    assert not any(isinstance(n, LoRAWeight) for _, n in nnx.iter_graph(plain))


@pytest.mark.parametrize("job", ["reward", "ppo"])
def test_reward_and_ppo_options_name_the_option_when_refused(job):
    """The shared LoRA rows (`run.options.LORA_OPTIONS`, dest "only_optimize_lora") of each
    job's table: none given is no LoRA; a refused value names the option."""
    from zeroxla.app.cli import build_parser
    from zeroxla.app.jobs import ppo, reward

    spec = {"reward": reward.SPEC, "ppo": ppo.SPEC}[job]
    required = {"reward": ["--init-from", "b", "--data", "d"],
                "ppo": ["--actor", "a", "--reward", "r", "--prompts", "p"]}[job]
    table = spec.table

    def tree(*argv):
        given = table.given(build_parser().parse_args([job, *required, *argv]))
        return table.build(given, **{f: given[f] for f in spec.required})

    assert tree().lora == LoRAConfig()
    assert tree("--lora-dim", "4", "--only-optimize-lora").lora == LoRAConfig(
        4, only_optimize_lora=True)
    with pytest.raises(ValueError, match=r"^--only-optimize-lora: LoRAConfig\.only_optimize_lora="
                                         r"True needs dim > 0"):
        tree("--only-optimize-lora")


def test_a_resumed_run_gets_its_lora_section_back():
    from zeroxla.app.jobs.train.resume import job_from_record, job_record, saved_job

    job = resolve_job({"lora_dim": 4, "lora_alpha": 8.0, "only_optimize_lora": True})
    record = json.loads(json.dumps(job_record(job)))         # as a checkpoint stores it
    assert job_from_record(record).lora == job.lora
    assert saved_job({"job_config": record}, {"steps": 9}).lora == job.lora
    # --resume with other adapters cannot continue the checkpoint's state: refused by name.
    from zeroxla.app.jobs.train.cli import make_tree

    tree, _ = make_tree({"resume": "RUN", "steps": 9}, {"job_config": record})
    assert tree.lora == job.lora and tree.schedule.steps == 9
    with pytest.raises(ValueError, match=r"--resume RUN continues the run as it was built; "
                                         r"--lora-dim 4 -> 8 cannot change"):
        make_tree({"resume": "RUN", "lora_dim": 8}, {"job_config": record})


@pytest.mark.slow
def test_ppo_with_lora_on_a_tiny_llama_reports_trainable_count_and_memory(tmp_path, capsys):
    pytest.importorskip("transformers")
    from zeroxla.app import chat_data
    from zeroxla.app.tiny_checkpoints import llama_checkpoint

    base = llama_checkpoint(tmp_path / "llama")
    chat_data.write_jsonl(chat_data.shakespeare_prompts(16, seed=2), tmp_path / "prompts.jsonl")
    chat_data.write_jsonl(chat_data.shakespeare_pairs(40, seed=1), tmp_path / "pairs.jsonl")
    # Step 1 with LoRA (rank 4 on wq): PPO's actor is that run merged, given new adapters.
    assert cli.main(["train", "--init-from", str(base), "--steps", "1", "--batch-size", "8",
                     "--seq-len", "32", "--eval-batches", "1", "--sample-tokens", "0",
                     "--lora-dim", "4", "--lora-module-name", "wq", "--lr", "0.1",
                     "--warmup-steps", "0", "--out", str(tmp_path / "sft"),
                     "--no-progress"]) == 0
    actor, _ = loading.load_actor(tmp_path / "sft")
    tokens = np.random.default_rng(0).integers(0, 500, (2, 11))
    assert not any(isinstance(n, LoRAWeight) for _, n in nnx.iter_graph(actor))
    np.testing.assert_allclose(np.asarray(actor(jnp.asarray(tokens, jnp.int32))),
                               _ours(tmp_path / "sft" / "checkpoint", tokens,
                                     LoRAConfig(4, 1.0, "wq")), rtol=1e-5, atol=1e-5)
    # Step 2 with LoRA too: the adapters and the fresh score head train (v_head [64]).
    reward = tmp_path / "rm"
    assert cli.main(["reward", "--init-from", str(base), "--data", str(tmp_path / "pairs.jsonl"),
                     "--steps", "2", "--batch-size", "8", "--seq-len", "64", "--eval-every", "2",
                     "--lora-dim", "8", "--only-optimize-lora", "--out", str(reward),
                     "--no-progress"]) == 0
    per_layer = sum(8 * (i + o) for i, o in ((64, 64), (64, 32), (64, 32), (64, 64),
                                             (64, 128), (64, 128), (128, 64)))
    rm_summary = json.loads((reward / "summary.json").read_text())
    assert rm_summary["parameters"]["trainable"] == 2 * per_layer + 64
    out = tmp_path / "ppo"
    assert cli.main(["ppo", "--actor", str(tmp_path / "sft"), "--reward", str(reward),
                     "--prompts", str(tmp_path / "prompts.jsonl"), "--iterations", "1",
                     "--per-iteration-prompts", "8", "--max-prompt-seq-len", "8",
                     "--max-answer-seq-len", "8", "--lora-dim", "8", "--only-optimize-lora",
                     "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    # Rank 8 on every block weight of both layers (the default module_name): wq [64, 4, 16],
    # wk, wv [64, 2, 16], wo [4, 16, 64], w_gate, w_up [64, 128], w_down [128, 64]; each
    # adapter is A [IN, 8] + B [8, OUT]. The critic (from the reward model, its adapters
    # merged) gets new adapters of the same shapes, and its value head v_head [64] trains too.
    for name, trainable in (("actor", 2 * per_layer), ("critic", 2 * per_layer + 64)):
        counts = summary["parameters"][name]
        assert counts["trainable"] == trainable, name
        assert counts["total"] > 5 * trainable, name
        # AdamW's mu and nu of those alone, float32, partitioned over the 8 devices, plus its
        # int32 step count.
        assert summary["memory"][name]["optimizer"] == 2 * 4 * trainable // 8 + 4, name
    assert summary["lora"]["dim"] == 8 and summary["lora"]["only_optimize_lora"]
