"""load_pretrained and `zeroxla export` against the golden checkpoints transformers wrote
(tests/assets/hf), no torch needed: the HF load / export path on every interpreter.

Each golden (a GPT-2 in one bfloat16 file; a GQA Llama sharded with an index, so the loader reads
tensors and parts of tensors across shards) is loaded onto the 2 x 4 mesh under ZeRO-3 with every
leaf partitioned; the gathered model must compute transformers' logits. Saved as a zeroxla
checkpoint with its tokenizer and exported, it must give back transformers' tensors (names,
shapes, values after the dtype round trip), its model config and its tokenizer files.
"""

import json

import ml_dtypes
import numpy as np
import pytest

import zeroxla
from hf_golden import ATOL, FAMILIES, golden, safetensors_of
from zeroxla.app import cli
from zeroxla.app.tokenizers.pretrained import PretrainedTokenizer
from zeroxla.app.tokenizers.records import tokenizer_record
from zeroxla.models import hf

EXPORT_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request):
    """(golden, step, state): the golden loaded on the 2 x 4 mesh, ZeRO-3, every leaf
    partitioned (each tensor read in pieces and spread over both nodes)."""
    g = golden(request.param)
    mesh = zeroxla.make_mesh(nodes=2, local=4)
    config = zeroxla.ZeroConfig(stage=3, persistence_threshold=0)
    step, state = zeroxla.load_pretrained(g.directory, mesh, config=config, progress=False)
    return g, step, state


@pytest.fixture(scope="module")
def saved(loaded, tmp_path_factory):
    """(golden, checkpoint directory): the loaded state saved with the golden's tokenizer in its
    metadata, as `zeroxla train --init-from` records it."""
    g, step, state = loaded
    directory = tmp_path_factory.mktemp(f"{g.family}-checkpoint")
    record = tokenizer_record(PretrainedTokenizer.from_dir(g.directory))
    zeroxla.save(directory, state, layout=step.layout, metadata={"tokenizer": record})
    return g, directory


def test_load_pretrained_on_2x4_gives_transformers_logits(loaded):
    g, step, state = loaded
    assert all(leaf.params_partitioned for leaf in step.layout.plan.leaves)
    ours = np.asarray(zeroxla.gathered_model(state)(g.inputs))       # [B, T, V]
    np.testing.assert_allclose(ours, g.logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", sorted(EXPORT_DTYPES))
def test_export_gives_back_the_golden(saved, tmp_path, dtype):
    g, directory = saved
    out = tmp_path / "hf"
    assert cli.main(["export", str(directory), str(out), "--dtype", dtype,
                     "--max-shard-size", "40KB"]) == 0

    if (g.directory / hf.INDEX_FILE).exists():      # sharded as the golden: an index + shards
        index = json.loads((out / hf.INDEX_FILE).read_text())["weight_map"]
        assert len(set(index.values())) > 1
    ours, theirs = safetensors_of(out), safetensors_of(g.directory)
    assert sorted(ours) == sorted(theirs)
    for name, want in theirs.items():                 # bfloat16, as transformers saved them
        got = ours[name]
        assert (got.dtype, got.shape) == (EXPORT_DTYPES[dtype], want.shape), name
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32),
                                      err_msg=name)

    exported = json.loads((out / "config.json").read_text())
    golden_config = json.loads((g.directory / "config.json").read_text())
    assert hf.from_hf_config(exported) == hf.from_hf_config(golden_config)
    stated = {key for key in exported.keys() & golden_config.keys()     # every value both state
              if exported[key] is not None and golden_config[key] is not None} - {"dtype"}
    assert len(stated) >= 12 and {"architectures", "model_type", "vocab_size"} <= stated
    assert {k: exported[k] for k in stated} == {k: golden_config[k] for k in stated}
    assert exported["dtype"] == dtype
    # The trained tokenizer's EOS (and BOS), so that transformers' generate stops where ours does.
    assert (exported["eos_token_id"], exported["bos_token_id"]) == (
        golden_config["eos_token_id"], golden_config["bos_token_id"]) == (511, 511)
    for name in ("tokenizer.json", "tokenizer_config.json"):          # written back unchanged
        assert (out / name).read_bytes() == (g.directory / name).read_bytes(), name
