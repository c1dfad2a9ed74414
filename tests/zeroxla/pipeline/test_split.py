"""DeepSpeed's layer list view of a model split over stages, and the tables the executor runs;
no devices needed."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from zeroxla import models
from zeroxla.sharding.model_def import ModelDef
from zeroxla.pipeline import GPipeSchedule, TrainSchedule, schedule_table
from zeroxla.pipeline.checks import check_table
from zeroxla.engine.loss import next_token_loss_terms
from zeroxla.pipeline.split import layer_list, split_stages
from zeroxla.pipeline.stages import check_stages

PROBE = {"inputs": jax.ShapeDtypeStruct((1, 2), jnp.int32),
         "targets": jax.ShapeDtypeStruct((1, 2), jnp.int32)}


def _view(name, num_layers):
    model = models.build(name, num_layers=num_layers)
    model_def = ModelDef.of(model)[0]
    cut = check_stages(next_token_loss_terms, lambda v: model_def.module(v, {}, None),
                       model_def.abstract_values()[0], PROBE)
    return layer_list(model, model_def.shape_dict(), cut.embed_paths, cut.head_paths)


def test_gpt_layer_list_counts_the_tied_embedding_once():
    view = _view("gpt-tiny", 2)
    cfg = models.GPTConfig.tiny()
    d, f = cfg.d_model, cfg.mlp_dim
    block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d           # attention, MLP, 2 LayerNorms
    assert view == [("Embed", (cfg.vocab_size + cfg.max_seq_len) * d), ("Block", block),
                    ("Block", block), ("head", 2 * d)]                 # head: ln_f only (tied)


def test_llama_layer_list():
    names = [name for name, _ in _view("llama-tiny", 3)]
    assert names == ["TokenEmbed", "Block", "Block", "Block", "Head"]


@pytest.mark.parametrize("method,stages,parts,blocks", [
    ("parameters", 2, (0, 3, 6), (2, 2)),
    ("uniform", 4, (0, 2, 4, 5, 6), (1, 2, 1, 0)),          # the last stage: head only
    ("type:block", 3, (0, 3, 4, 6), (2, 1, 1)),
])
def test_split(method, stages, parts, blocks):
    split = split_stages(_view("llama-tiny", 4), stages, method)
    assert split.parts == parts and split.num_layers == blocks
    assert sum(split.num_layers) == 4
    assert split.max_layers == max(blocks)
    index, mask = split.layer_index(), split.layer_mask()
    for s in range(stages):
        real = [i for i, keep in zip(index[s], mask[s]) if keep]
        assert real == list(range(split.first_layer[s], split.first_layer[s] + blocks[s]))
        assert all(0 <= i < 4 for i in index[s])               # padding slots index a real layer


def test_describe():
    text = split_stages(_view("llama-tiny", 4), 4, "uniform").describe()
    assert "stage 0: embedding, blocks 0..0" in text
    assert "stage 1: blocks 1..2 " in text
    assert "stage 3: no blocks, head" in text


@pytest.mark.parametrize("schedule", [TrainSchedule, GPipeSchedule])
@pytest.mark.parametrize("micro_batches,stages", [(1, 4), (3, 2), (8, 4)])
def test_shipped_tables_run(schedule, micro_batches, stages):
    check_table(schedule_table(schedule, micro_batches, stages))


def test_a_table_with_a_skipped_hop_is_refused():
    table = schedule_table(TrainSchedule, 2, 2)
    op = [list(row) for row in table.op]
    micro_batch = [list(row) for row in table.micro_batch]
    # Stage 1's first forward one step late: its input would have been overwritten in transit.
    op[1][1], op[2][1] = 0, 1
    micro_batch[1][1], micro_batch[2][1] = -1, 0
    bad = dataclasses.replace(table, op=tuple(map(tuple, op)),
                              micro_batch=tuple(map(tuple, micro_batch)))
    with pytest.raises(ValueError, match=r"step 2 stage 1: its input was not computed by stage 0 "
                                         r"at step 1"):
        check_table(bad)
