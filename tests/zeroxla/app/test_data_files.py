"""Every job's data option reads Parquet and `datasets` directories as it reads JSON lines
(zeroxla/app/data_files.py), in TRL's and verl's column layouts.

References: the JSON-lines reader (DeepSpeed-Chat's `{"prompt", "response"}`, the path the jobs
had before Parquet) for the rows, the token batches and the training losses; transformers'
`apply_chat_template` for a chat prompt rendered with its generation prompt; the rows as written
for what verl's `compute_score` receives.
"""

import json
import re
import sys

import numpy as np
import pytest

import zeroxla
from zeroxla import models
from zeroxla.app import chat_data, cli
from zeroxla.app.jobs import dpo as dpo_job
from zeroxla.app.jobs.train import job as train_job
from zeroxla.app.jobs.train.data import load_train_data
from zeroxla.app.jobs.train.resolve import resolve_job
from zeroxla.app.prompt_files import prompt_records
from zeroxla.rlhf import DPOConfig, GRPOConfig
from zeroxla.rlhf.grpo.trainer import GRPOTrainer
from zeroxla.rlhf.grpo.reward_funcs import accuracy_reward

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

EXAMPLES = chat_data.shakespeare_sft(40, seed=3)


def write_parquet(rows, path, row_group_size=7):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


@pytest.fixture(scope="module")
def sft_sources(tmp_path_factory):
    """{name: (--data, --split)}: the same examples as DeepSpeed-Chat's JSON lines, and in TRL's
    prompt/completion layout as a Parquet file (row groups of 7), a directory of two Parquet
    shards and (when datasets is installed) a DatasetDict's train split."""
    tmp = tmp_path_factory.mktemp("sft")
    jsonl = chat_data.write_jsonl(EXAMPLES, tmp / "sft.jsonl")
    trl = [{"prompt": e.prompt, "completion": e.response} for e in EXAMPLES]
    shards = tmp / "shards"
    shards.mkdir()
    write_parquet(trl[:25], shards / "part-00000.parquet")
    write_parquet(trl[25:], shards / "part-00001.parquet")
    sources = {"jsonl": (str(jsonl), None),
               "parquet": (str(write_parquet(trl, tmp / "sft.parquet")), None),
               "shards": (str(shards), None)}
    try:
        import datasets
    except ImportError:
        return sources
    datasets.DatasetDict({"train": datasets.Dataset.from_list(trl),
                          "test": datasets.Dataset.from_list(trl[:3])}).save_to_disk(tmp / "dd")
    sources["datasets"] = (str(tmp / "dd"), "train")
    return sources


def test_every_source_gives_the_rows_and_token_batches_of_the_json_lines(sft_sources):
    want = load_train_data(*sft_sources["jsonl"][:1], tokenizer="byte", init_from=None,
                           batch_size=8, seq_len=64, val_fraction=0.2, seed=0, packing=True)
    for name, (path, split) in sft_sources.items():
        examples = chat_data.read_sft_jsonl(path, split)
        assert [(e.prompt, e.response) for e in examples] == [
            (e.prompt, e.response) for e in EXAMPLES], name
        got = load_train_data(path, split=split, tokenizer="byte", init_from=None,
                              batch_size=8, seq_len=64, val_fraction=0.2, seed=0, packing=True)
        for part in ("train", "val"):
            assert getattr(got, part).keys() == getattr(want, part).keys()
            for key, value in getattr(want, part).items():
                np.testing.assert_array_equal(getattr(got, part)[key], value,
                                              err_msg=f"{name} {part} {key}")
    assert len(sft_sources) == 3 + ("datasets" in sft_sources)


def _losses(path, split, out, steps):
    job = resolve_job(dict(data=path, split=split, tokenizer="byte", steps=steps, batch_size=8,
                           seq_len=64, eval_every=steps, eval_batches=1, sample_tokens=0,
                           out_dir=str(out), progress=False))
    train_job.run(job, write=lambda line: None)
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


@pytest.mark.slow
def test_parquet_trains_with_the_json_lines_losses(sft_sources, tmp_path):
    want = _losses(*sft_sources["jsonl"], tmp_path / "jsonl", 3)
    got = _losses(*sft_sources["parquet"], tmp_path / "parquet", 3)
    assert len(want) == 3 and got == want


@pytest.mark.slow
def test_twenty_steps_from_every_source_give_equal_losses(sft_sources, tmp_path):
    want = _losses(*sft_sources["jsonl"], tmp_path / "jsonl", 20)
    print(f"20 SFT steps from JSON lines: loss {want[0]:.4f} -> {want[-1]:.4f}")
    for name in ("parquet", "shards", "datasets"):
        if name in sft_sources:
            assert _losses(*sft_sources[name], tmp_path / name, 20) == want, name


def test_a_datasetdict_needs_one_of_its_splits(sft_sources, tmp_path):
    pytest.importorskip("datasets")
    path, _ = sft_sources["datasets"]
    for split, why in ((None, "no split given"), ("val", "split 'val' is not one of them")):
        with pytest.raises(chat_data.ChatDataError, match=re.escape(
                f"{path}: a DatasetDict of splits ['test', 'train'] ({why})")):
            chat_data.read_sft_jsonl(path, split)
    assert len(chat_data.read_sft_jsonl(path, "test")) == 3
    with pytest.raises(chat_data.ChatDataError, match="split 'train' given for .*sft.jsonl, "
                                                      "which has no splits"):
        chat_data.read_sft_jsonl(sft_sources["jsonl"][0], "train")
    with pytest.raises(ValueError, match="--split 'train' with --data None is invalid"):
        dpo_job.DPOJobConfig(init_from="x", split="train")


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "P", "completion": 1}], "row 1: field 'completion' is an int; accepted: a "
                                         "string"),
    ([{"prompt": "P", "completion": "C"}, {"prompt": None, "completion": "A"}],
     "row 2: missing field 'prompt'"),
    ([{"prompt": [{"role": "user", "content": "Q"}],
       "completion": [{"role": "user", "content": "A"}]}],
     "row 1: field 'completion' ends with a user message")])
def test_a_bad_cell_names_the_file_the_row_and_the_column(rows, message, tmp_path):
    path = write_parquet(rows, tmp_path / "bad.parquet")
    with pytest.raises(chat_data.ChatDataError, match=re.escape(f"{path} {message}")):
        chat_data.read_sft_jsonl(path)


def test_a_missing_reader_is_refused_naming_the_extra_before_the_run_directory(
        tmp_path, monkeypatch, capsys):
    path = write_parquet([{"prompt": "P", "chosen": "C", "rejected": "R"}], tmp_path / "p.parquet")
    # None in sys.modules marks a module not importable: find_spec("pyarrow") is then None.
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    out = tmp_path / "run"
    assert cli.main(["dpo", "--init-from", str(tmp_path / "nowhere"), "--data", str(path),
                     "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "needs the package pyarrow, which is not installed (pip install \"zeroxla[data]\")" \
        in err, err
    assert not out.exists()


def test_a_data_directory_is_fingerprinted_by_its_files(sft_sources, tmp_path):
    """A resumed run refuses data changed since (`resume.check_data`): a directory's fingerprint
    follows its files' names and bytes, not where it lies."""
    import shutil

    from zeroxla.app.run.resume import fingerprint

    shards = sft_sources["shards"][0]
    copy = shutil.copytree(shards, tmp_path / "copy")
    assert fingerprint(copy) == fingerprint(shards)
    first = copy / "part-00000.parquet"
    first.write_bytes(first.read_bytes()[:-1] + b"\0")
    changed = fingerprint(copy)
    assert changed != fingerprint(shards)
    (copy / "part-00002.parquet").write_bytes(b"")
    assert fingerprint(copy) != changed


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    from chat_checkpoints import write_chat_tokenizer
    from zeroxla.app.tokenizers.pretrained import PretrainedTokenizer

    directory = write_chat_tokenizer(tmp_path_factory.mktemp("chat"))
    return directory, PretrainedTokenizer.from_dir(directory)


def verl_rows(n):
    """verl's layout (its gsm8k recipe's columns) for `n` problems of the answer i + 2."""
    return [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "user", "content": f"What is {i} + 2?"}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 2)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def test_verl_rows_reach_compute_score_as_verl_passes_them(chat_tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    directory, tokenizer = chat_tokenizer
    rows = verl_rows(4)
    records = prompt_records(write_parquet(rows, tmp_path / "verl.parquet"), None, tokenizer)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    for record, row in zip(records, rows):
        assert record["prompt"] == hf.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=False)
        assert record["ground_truth"] == row["reward_model"]["ground_truth"]
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return {"score": float(solution_str == f"#### {ground_truth}"), "acc": 1}

    config = GRPOConfig(num_generations=2, prompts_per_iteration=4, max_completion_length=2,
                        prompt_length=max(len(tokenizer.encode(r["prompt"])) for r in records))
    trainer = GRPOTrainer(config, models.build("gpt-tiny", vocab_size=tokenizer.vocab_size,
                                               max_seq_len=64, num_layers=1),
                          mesh=zeroxla.make_mesh(2, 4), tokenizer=tokenizer, prompts=records,
                          reward_funcs=[compute_score, accuracy_reward], inference_tp_size=1)
    completions = tuple(f"#### {i + 2 + g}" for i in range(4) for g in range(2))
    width = config.prompt_length + 2
    total, parts = trainer.score(np.arange(4), np.zeros((8, width), np.int32),
                                 np.ones((8, width), np.float32), completions)
    assert seen == [("openai/gsm8k", completions[2 * i + g], str(i + 2),
                     {"split": "train", "index": i}) for i in range(4) for g in range(2)]
    want = np.tile([1.0, 0.0], 4)                  # answer g = 0 is the ground truth
    verl, accuracy = parts.values()                # in the order of reward_funcs
    np.testing.assert_array_equal(verl, want)
    np.testing.assert_array_equal(accuracy, want)
    np.testing.assert_array_equal(total, 2 * want)


def test_trl_pairs_from_parquet_are_the_json_lines_pairs(chat_tokenizer, tmp_path):
    _, tokenizer = chat_tokenizer
    rows = [{"prompt": [{"role": "user", "content": f"Who speaks {i}?"}],
             "chosen": [{"role": "assistant", "content": "The king."}],
             "rejected": [{"role": "assistant", "content": f"Gone, my lord {i}."}]}
            for i in range(10)]
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = write_parquet(rows, tmp_path / "pairs.parquet", row_group_size=3)
    batches = [dpo_job.pair_rows(dpo_job.DPOJobConfig(init_from="x", data=str(path),
                                                      dpo=DPOConfig(batch_size=8),
                                                      val_fraction=0.2), tokenizer)
               for path in (jsonl, parquet)]
    for want, got in zip(batches[0][:2], batches[1][:2]):
        assert want.keys() == got.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)


# The child's own peak RSS: /proc/self/status's VmHWM, the high-water mark of this program's
# memory since its exec (getrusage's ru_maxrss keeps the parent's peak across fork and exec: a
# pytest worker of several GiB would hide the child's figure).
STREAM_CHILD = """
import sys
import pyarrow.parquet as pq
from zeroxla.app import data_files

def peak_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))

base = peak_kib()                                                    # after the imports
if sys.argv[2] == "stream":
    count = sum(len(row.record["prompt"]) > 0 for row in data_files.rows(sys.argv[1]))
else:
    count = pq.read_table(sys.argv[1]).num_rows                      # the whole table at once
print(count, base / 1024, peak_kib() / 1024)
"""


def _peak_rss_mib(path, how):
    """(rows read, the child's peak RSS in MiB after its imports, its peak RSS at the end)."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", STREAM_CHILD, str(path), how], check=True,
                          capture_output=True, text=True, timeout=600)
    count, base, peak = done.stdout.split()
    return int(count), float(base), float(peak)


@pytest.mark.slow
def test_a_parquet_file_larger_than_the_limit_streams(tmp_path):
    """200,000 rows of 1,000 random letters (200 MB of text, 100 row groups): iterating the
    rows raises the reader process's peak RSS (its VmHWM, measured in a child
    process) by less than `limit_mib` over its peak after the imports (JAX's among them),
    where reading the table whole raises it by more than the text's size."""
    rows, width, group, limit_mib = 200_000, 1_000, 2_000, 64
    path = tmp_path / "large.parquet"
    rng = np.random.default_rng(0)
    schema = pa.schema([("prompt", pa.string()), ("answer", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, group):
            letters = rng.integers(97, 123, (group, width), dtype=np.uint8)
            texts = [bytes(r).decode() for r in letters]
            writer.write_table(pa.table({"prompt": texts, "answer": [str(start)] * group},
                                        schema=schema), row_group_size=group)
    text_mib = rows * width / 2**20
    count, base, streamed = _peak_rss_mib(path, "stream")
    _, whole_base, whole = _peak_rss_mib(path, "whole")
    print(f"Parquet {path.stat().st_size / 2**20:.0f} MiB on disk, {text_mib:.0f} MiB of text, "
          f"{pq.ParquetFile(path).num_row_groups} row groups: peak RSS {base:.0f} MiB after the "
          f"imports, {streamed:.0f} MiB after streaming every row (limit +{limit_mib}); "
          f"{whole_base:.0f} -> {whole:.0f} MiB reading the table whole")
    assert count == rows
    assert streamed - base < limit_mib < text_mib <= whole - whole_base


def verl_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A verl reward function: 1 for the task's marked answer, else 0 (a dict, as verl's may)."""
    assert data_source == "zeroxla/arithmetic" and extra_info["split"] == "train"
    return {"score": float(solution_str.strip() == f"#### {ground_truth}")}


@pytest.mark.slow
def test_verl_grpo_and_trl_dpo_runs_complete_on_parquet(tmp_path, capsys):
    """`zeroxla grpo` on the bundled arithmetic task written in verl's layout (chat prompts,
    reward_model.ground_truth, extra_info) as Parquet, scored by a verl compute_score and the
    built-in accuracy; `zeroxla dpo` on the bundled pairs in TRL's conversational layout."""
    from chat_checkpoints import padded_gpt2_checkpoint
    from zeroxla.rlhf.grpo import arithmetic_task as task

    base = padded_gpt2_checkpoint(tmp_path / "gpt2")
    problems, _ = task.split_problems(16, 0, seed=0)
    verl = write_parquet([{"data_source": "zeroxla/arithmetic", "ability": "math",
                           "prompt": [{"role": "user", "content": p["prompt"].strip()}],
                           "reward_model": {"style": "rule", "ground_truth": p["answer"]},
                           "extra_info": {"split": "train", "index": i}}
                          for i, p in enumerate(problems)], tmp_path / "verl.parquet")
    pairs = write_parquet([{"prompt": [{"role": "user", "content": p.prompt}],
                            "chosen": [{"role": "assistant", "content": p.chosen}],
                            "rejected": [{"role": "assistant", "content": p.rejected}]}
                           for p in chat_data.shakespeare_pairs(40, seed=1)],
                          tmp_path / "pairs.parquet")
    sft = chat_data.write_jsonl(chat_data.shakespeare_sft(16), tmp_path / "sft.jsonl")
    actor = tmp_path / "sft"
    assert cli.main(["train", "--init-from", str(base), "--data", str(sft), "--steps", "1",
                     "--batch-size", "8", "--seq-len", "64", "--sample-tokens", "0",
                     "--out", str(actor), "--no-progress"]) == 0
    assert cli.main(["grpo", "--actor", str(actor), "--prompts", str(verl), "--reward-funcs",
                     f"{__name__}:verl_compute_score", "accuracy", "--iterations", "2",
                     "--num-generations", "2", "--per-iteration-prompts", "4",
                     "--max-completion-length", "6", "--out", str(tmp_path / "grpo"),
                     "--no-progress"]) == 0
    assert cli.main(["dpo", "--init-from", str(base), "--data", str(pairs), "--steps", "2",
                     "--batch-size", "8", "--seq-len", "96", "--eval-every", "2",
                     "--out", str(tmp_path / "dpo"), "--no-progress"]) == 0
    capsys.readouterr()
    grpo, dpo = ([json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text()
                  .splitlines()] for run in ("grpo", "dpo"))
    print(f"grpo on verl Parquet: rewards {[r['reward'] for r in grpo]}; dpo on TRL Parquet: "
          f"losses {[r['loss'] for r in dpo if 'loss' in r]}")
    assert [r["iteration"] for r in grpo] == [0, 1]
    assert all(np.isfinite(r["loss"]) for r in grpo + dpo if "loss" in r)
    assert json.loads((tmp_path / "grpo/summary.json").read_text())["settings"]["prompts"] \
        == str(verl)
