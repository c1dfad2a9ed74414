"""`zeroxla export --adapter-only`'s checks and the base it names, on llama-tiny LoRA checkpoints
saved from one initialised ZeRO-0 state on one device (no training step is compiled): a run whose
base trained with the adapters is refused by name (PEFT's base + adapters would not be the
trained model) while its merged export goes on; the adapter names the base its run recorded
(`adapters_base`: an HF directory, or a zeroxla run's checkpoint step); an adapter on the
embedding table is refused naming the table. The exports' logits against transformers and peft
are `test_lora_export.py`'s and the jobs' (`tests/zeroxla/app/test_lora_*jobs.py`)."""

import dataclasses
import json

import jax
import pytest
from flax import nnx

from zeroxla import checkpoint
from zeroxla.app import cli
from zeroxla.app.jobs.loading import BASE_KEY, adapters_base, recorded_base
from zeroxla.checkpoint.adapters import METADATA_KEY, as_metadata
from zeroxla.lora import LoRAConfig, convert_linear_layer_to_lora
from zeroxla.lora.export import save_peft_adapter
from zeroxla.make import make_step
from zeroxla.models import Llama, LlamaConfig
from zeroxla.sharding.config import ZeroConfig
from zeroxla.sharding.mesh import make_mesh

CONFIG = LlamaConfig.tiny()
LORA = LoRAConfig(dim=4, alpha=8.0, module_name=r"blocks/layers/(wq|wv)")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """save(run_name, lora, **metadata) -> the checkpoint directory of one adapted llama-tiny
    state (step 0), its metadata recording `lora` (only_optimize_lora as the run had it)."""
    def adapted():
        model = Llama(CONFIG, rngs=nnx.Rngs(0))
        convert_linear_layer_to_lora(model, LORA, rngs=nnx.Rngs(1))
        return model

    step = make_step(adapted, make_mesh(1, 1, devices=jax.devices()[:1]),
                     config=ZeroConfig(stage=0))
    state = step.init()
    root = tmp_path_factory.mktemp("lora_ckpt")

    def save(name, lora, **metadata):
        directory = root / name / "checkpoint"
        checkpoint.save(directory, state, layout=step.layout,
                        metadata={METADATA_KEY: as_metadata(lora), **metadata})
        return directory
    return save


def test_adapter_only_export_of_a_run_whose_base_trained_is_refused(saved, tmp_path, capsys):
    directory = saved("full", LORA)                        # no --only-optimize-lora
    out = tmp_path / "adapter"
    assert cli.main(["export", str(directory), str(out), "--adapter-only"]) == 2
    assert not out.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (
        f"zeroxla export: error: export --adapter-only: checkpoint {directory / '0'} is of a "
        "LoRA run whose base weights trained too (recorded only_optimize_lora=False: run "
        "without --only-optimize-lora), so its adapters on the base would not give the trained "
        "model; accepted: that checkpoint exported merged (zeroxla export without "
        "--adapter-only), or --adapter-only of a run with --only-optimize-lora"), err
    # The merged export is the trained model, and goes on.
    assert cli.main(["export", str(directory), str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "model.safetensors").is_file()


def test_adapter_names_the_base_its_run_recorded(saved, tmp_path, capsys):
    only = dataclasses.replace(LORA, only_optimize_lora=True)
    hf_base = tmp_path / "hf_base"
    hf_base.mkdir()
    (hf_base / "config.json").write_text("{}")
    # dpo / grpo record BASE_KEY; a `zeroxla train` run its --init-from in the job's tree.
    cases = (({BASE_KEY: str(hf_base)}, str(hf_base)),
             ({"job_config": {"model": {"init_from": "llama_dir"}}}, "llama_dir"),
             ({}, None))                                            # a preset's run
    for i, (metadata, expected) in enumerate(cases):
        name = f"run{i}"
        directory = saved(name, only, **metadata)
        assert recorded_base(checkpoint.read_metadata(directory)) == expected
        assert cli.main(["export", str(directory), str(tmp_path / name), "--adapter-only"]) == 0
        report = json.loads(capsys.readouterr().out)
        written = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert report["base_model_name_or_path"] == written["base_model_name_or_path"] == expected


def test_adapters_base_is_an_hf_directory_or_a_runs_checkpoint_step(saved, tmp_path,
                                                                   monkeypatch):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert adapters_base("hf") == str(hf_dir)                           # made absolute
    run = saved("sft", LORA).parent
    # A zeroxla run (GRPO's --actor, DPO's --init-from of a run): the step the job read merged.
    assert adapters_base(run) == str(run / "checkpoint" / "0")
    assert adapters_base(run / "checkpoint") == str(run / "checkpoint" / "0")


def test_an_adapter_on_the_embedding_table_is_refused_naming_it(tmp_path):
    model = Llama(CONFIG, rngs=nnx.Rngs(0))
    lora = LoRAConfig(dim=4, module_name=r"^embed/")
    assert convert_linear_layer_to_lora(model, lora, rngs=nnx.Rngs(1)) == ("embed/weight",)
    with pytest.raises(ValueError) as err:
        save_peft_adapter(model, lora, CONFIG, tmp_path / "adapter")
    assert str(err.value) == (
        "PEFT export of the adapter on 'embed/weight': HF tensor model.embed_tokens.weight is an "
        "embedding table (transformers' nn.Embedding [num_embeddings, embedding_dim]), whose "
        "PEFT adapter is lora_embedding_A / lora_embedding_B, which this export does not write; "
        "accepted: adapters on weights each mapped to one nn.Linear (Llama's projections and "
        "lm_head): leave the embedding out of --lora-module-name, or export the merged model")
    assert not (tmp_path / "adapter").exists()
