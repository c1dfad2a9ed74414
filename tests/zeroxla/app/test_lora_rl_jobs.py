"""LoRA in `zeroxla dpo` and `zeroxla grpo` (zeroxla train's --lora-dim, --lora-alpha,
--lora-module-name, --only-optimize-lora): the options reach the jobs, refusals name the
option; on a tiny Llama written by transformers, two DPO steps and then two GRPO iterations
(its actor the DPO run, read merged) with `--lora-dim 4 --only-optimize-lora` count as trainable
exactly the adapters' elements, computed here from the checkpoint's config.json, leave every
base weight of their final checkpoint bitwise the starting model's, and export the merged
model (transformers' logits equal our merged load of the run) and, `--adapter-only`, a PEFT
adapter naming the base it trained on (DPO's --init-from, GRPO's actor checkpoint step) that
peft turns into the trained model (1e-4)."""

import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

from zeroxla.app import chat_data, cli
from zeroxla.app.jobs import dpo as dpo_job
from zeroxla.app.jobs import grpo as grpo_job
from zeroxla.app.jobs import loading
from zeroxla.app.run import command
from zeroxla.app.run.resume import tree_from_record, tree_record
from zeroxla.app.cli import build_parser
from zeroxla.app.tiny_checkpoints import MAX_POSITIONS, tokenizer_vocab_size, write_tokenizer
from zeroxla.lora import LoRAConfig, LoRAWeight
from zeroxla.models import GPTConfig
from zeroxla.models.hf_config import to_hf_config
from zeroxla.rlhf.dpo.losses import DPOConfig
from job_runs import distinct_chars

LORA = ["--lora-dim", "4", "--lora-alpha", "8", "--lora-module-name", "wq|wv",
        "--only-optimize-lora"]


@pytest.mark.parametrize("job, start", [(dpo_job, "--init-from"), (grpo_job, "--actor")],
                         ids=["dpo", "grpo"])
def test_lora_options_reach_the_tree(job, start):
    for argv, lora in ((LORA, LoRAConfig(dim=4, alpha=8.0, module_name="wq|wv",
                                         only_optimize_lora=True)), ([], LoRAConfig())):
        args = build_parser().parse_args([job.SPEC.name, start, "runs/sft", *argv])
        tree, _, _ = command.resolve(job.SPEC, job.OPTIONS.given(args))
        assert tree.lora == lora


@pytest.fixture(scope="module")
def gpt_base(tmp_path_factory):
    """A GPT-2 config.json and tokenizer, no weights: refusals come before weights are read."""
    directory = write_tokenizer(tmp_path_factory.mktemp("base"))
    config = GPTConfig(vocab_size=tokenizer_vocab_size(), max_seq_len=MAX_POSITIONS,
                       num_layers=2, d_model=64, num_heads=4, mlp_dim=256)
    (directory / "config.json").write_text(json.dumps(to_hf_config(config)))
    return directory


@pytest.mark.parametrize("command, argv, message", [
    ("dpo", ["--init-from", "BASE", "--only-optimize-lora"],
     "--only-optimize-lora: LoRAConfig.only_optimize_lora=True needs dim > 0"),
    ("dpo", ["--init-from", "BASE", "--lora-dim", "4", "--lora-module-name", "blocks/nope"],
     "--lora-module-name 'blocks/nope': LoRAConfig.module_name='blocks/nope' matches none of "
     "the linear weights"),
    ("grpo", ["--actor", "NOWHERE", "--only-optimize-lora"],
     "--only-optimize-lora: LoRAConfig.only_optimize_lora=True needs dim > 0"),
], ids=["dpo-only-without-dim", "dpo-module-name", "grpo-only-without-dim"])
def test_lora_refusals_name_the_option(command, argv, message, gpt_base, tmp_path, capsys):
    argv = [str(gpt_base) if a == "BASE" else a for a in argv]
    out = tmp_path / "run"
    extra = [] if "--resume" in argv else ["--out", str(out)]
    extra += ["--no-progress"] if command == "dpo" else []
    assert cli.main([command, *argv, *extra]) == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert message in err, err


def test_dpo_job_record_keeps_the_lora_settings():
    job = dpo_job.DPOJobConfig(init_from="x", dpo=DPOConfig(batch_size=8),
                               lora=LoRAConfig(4, 8.0, "wq", True))
    record = json.loads(json.dumps(tree_record(job)))        # as the checkpoint stores it
    assert tree_from_record(dpo_job.DPOJobConfig, record) == job
    with pytest.raises(ValueError, match=r"DPOJobConfig\.lora=4 is invalid; accepted: a "
                                         r"LoRAConfig"):
        dpo_job.DPOJobConfig(init_from="x", dpo=DPOConfig(batch_size=8), lora=4)
    with pytest.raises(ValueError, match=r"GRPOJobConfig\.lora=\{'dim': 4\} is invalid; "
                                         r"accepted: a LoRAConfig"):
        grpo_job.GRPOJobConfig(actor="x", lora={"dim": 4})


# ---- slow: the jobs on a tiny Llama ----------------------------------------------------------

def adapter_elements(hf_dir, rank):
    """sum over layers and block weights of rank x (in + out), from transformers' config.json:
    q, k, v, o, gate, up, down projections (the default --lora-module-name, every block
    weight)."""
    c = json.loads((hf_dir / "config.json").read_text())
    d, f, k = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * k, c["num_key_value_heads"] * k
    shapes = ((d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d))
    return c["num_hidden_layers"] * sum(rank * (i + o) for i, o in shapes)


def stored_params(checkpoint_dir):
    from zeroxla.checkpoint import StoredArrays

    arrays = StoredArrays(checkpoint_dir)
    return {name[len("params/"):]: arrays.read(name) for name in arrays.meta["arrays"]
            if name.startswith("params/")}


def assert_base_unchanged(stored, start):
    """Every weight of the plain `start` model is in `stored` bit for bit (an adapted one as
    '<path>/base'); the rest of `stored` is the adapters of every block weight, trained."""
    values = {"/".join(map(str, path)): np.asarray(v.get_value())
              for path, v in nnx.to_flat_state(nnx.state(start, nnx.Param))}
    adapted = {p[:-len("/lora_a")] for p in stored if p.endswith("/lora_a")}
    assert adapted == {f"blocks/layers/{w}" for w in ("wq", "wk", "wv", "wo", "w_gate", "w_up",
                                                      "w_down")}
    for path, value in values.items():
        kept = stored[f"{path}/base" if path in adapted else path]
        assert kept.dtype == value.dtype == np.float32, path
        np.testing.assert_array_equal(kept.view(np.uint32), value.view(np.uint32), err_msg=path)
    adapters = {f"{p}/{f}" for p in adapted for f in ("lora_a", "lora_b")}
    assert set(stored) == {f"{p}/base" if p in adapted else p for p in values} | adapters
    assert any(np.any(stored[f"{p}/lora_b"] != 0) for p in adapted)     # B left zero: trained


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    """(Llama HF dir, DPO run dir, its summary): 2 steps, LoRA rank 4, adapters alone."""
    pytest.importorskip("transformers")
    from zeroxla.app.tiny_checkpoints import llama_checkpoint

    tmp = tmp_path_factory.mktemp("lora_dpo")
    base = llama_checkpoint(tmp / "llama")
    pairs = chat_data.write_jsonl(chat_data.shakespeare_pairs(40, seed=1), tmp / "pairs.jsonl")
    out = tmp / "dpo"
    assert cli.main(["dpo", "--init-from", str(base), "--data", str(pairs), "--steps", "2",
                     "--batch-size", "8", "--seq-len", "64", "--eval-every", "2",
                     "--learning-rate", "1e-2", "--lora-dim", "4", "--only-optimize-lora",
                     "--out", str(out), "--no-progress"]) == 0
    return base, out, json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_dpo_resume_refuses_other_adapters_naming_the_option(dpo_run, capsys):
    """The checkpoint's state holds rank-4 adapters: another rank cannot continue it."""
    _, out, _ = dpo_run
    assert cli.main(["dpo", "--resume", str(out), "--lora-dim", "8", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--lora-dim 4 -> 8 cannot change" in err, err


@pytest.mark.slow
def test_dpo_with_lora_trains_the_adapters_alone_and_exports_merged(dpo_run):
    torch = pytest.importorskip("torch")
    import jax.numpy as jnp
    import transformers

    from zeroxla.models import hf as hf_io

    base, out, summary = dpo_run
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    adapters = adapter_elements(base, 4)
    assert summary["parameters"] == {
        "trainable": adapters, "total": sum(p.numel() for p in hf_base.parameters()) + adapters}
    assert summary["settings"]["lora"] == dataclasses.asdict(LoRAConfig(4, 1.0,
                                                                        only_optimize_lora=True))
    assert_base_unchanged(stored_params(out / "checkpoint"), hf_io.load_hf_model(base)[1])

    # --init-from this run reads it merged (the policy DPO or GRPO would start from); the
    # exported policy_hf/ (merged in float64 numpy) gives its logits in transformers.
    _, load = loading.open_policy(str(out), 64)
    merged = load()
    assert not any(isinstance(n, LoRAWeight) for _, n in nnx.iter_graph(merged))
    tokens = np.random.default_rng(0).integers(0, 500, (2, 11))
    ours = np.asarray(merged(jnp.asarray(tokens, jnp.int32)))

    def logits(model):
        with torch.no_grad():
            return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()

    exported = transformers.AutoModelForCausalLM.from_pretrained(out / "policy_hf").eval()
    np.testing.assert_allclose(logits(exported), ours, rtol=1e-4, atol=1e-4)
    assert np.abs(logits(hf_base) - ours).max() > 1e-3       # the adapters moved the policy

    # --adapter-only names the --init-from the adapters apply to; peft on it is the policy.
    peft = pytest.importorskip("peft")
    adapter = out / "adapter"
    assert cli.main(["export", str(out / "checkpoint"), str(adapter), "--adapter-only"]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.absolute())
    adapted = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]),
        adapter).eval()
    np.testing.assert_allclose(logits(adapted), ours, rtol=1e-4, atol=1e-4)


def _adapter_on_the_actor_is_the_trained_actor(actor_run, out, tmp_path):
    """GRPO's --adapter-only names the --actor run's checkpoint step the adapters were trained
    on (the DPO run, read merged); that step exported, plus the adapter in peft, gives the
    trained actor's logits (its merged actor_hf/, 1e-4)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import transformers

    adapter = tmp_path / "grpo_adapter"
    assert cli.main(["export", str(out / "checkpoint"), str(adapter), "--adapter-only"]) == 0
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    steps = [p.name for p in (actor_run / "checkpoint").iterdir() if p.name.isdigit()]
    assert base == str((actor_run / "checkpoint" / max(steps, key=int)).absolute())
    assert cli.main(["export", base, str(tmp_path / "actor_base")]) == 0
    tokens = torch.as_tensor(np.random.default_rng(0).integers(0, 500, (2, 11)))
    load = transformers.AutoModelForCausalLM.from_pretrained
    adapted = peft.PeftModel.from_pretrained(load(tmp_path / "actor_base"), adapter).eval()
    with torch.no_grad():
        np.testing.assert_allclose(adapted(tokens).logits.numpy(),
                                   load(out / "actor_hf").eval()(tokens).logits.numpy(),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_grpo_with_lora_on_a_lora_actor_trains_the_adapters_alone(dpo_run, tmp_path, capsys):
    from zeroxla.app.jobs.loading import load_actor

    base, actor_run, _ = dpo_run
    prompts = chat_data.write_jsonl(chat_data.shakespeare_prompts(16, seed=2),
                                    tmp_path / "prompts.jsonl")
    out = tmp_path / "grpo"
    assert cli.main(["grpo", "--actor", str(actor_run), "--prompts", str(prompts),
                     "--reward-funcs", f"{__name__}:distinct_chars", "--iterations", "2",
                     "--num-generations", "2", "--per-iteration-prompts", "4",
                     "--max-prompt-seq-len", "8", "--max-completion-length", "6",
                     "--learning-rate", "1e-2", "--lora-dim", "4", "--only-optimize-lora",
                     "--out", str(out)]) == 0
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parameters"]["trainable"] == adapter_elements(base, 4)
    assert summary["lora"] == dataclasses.asdict(LoRAConfig(4, 1.0, only_optimize_lora=True))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    # The actor started from the DPO run merged (its adapters folded into the weights, so the
    # new adapters' base is the merged model), which the final checkpoint keeps bit for bit.
    start, _ = load_actor(actor_run)
    assert_base_unchanged(stored_params(out / "checkpoint"), start)
    assert (out / "actor_hf" / "config.json").is_file()
    _adapter_on_the_actor_is_the_trained_actor(actor_run, out, tmp_path)
    # Resuming with other LoRA settings is refused, naming the option, before any model is
    # read (the checkpoint's state holds rank-4 adapters).
    assert cli.main(["grpo", "--resume", str(out), "--lora-dim", "8", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--lora-dim 4 -> 8 cannot change" in err, err
