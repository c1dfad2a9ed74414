"""The RL jobs' records of two source trees compared field by field: GRPO, PPO and DPO, each on
a 2 x 4 mesh without and with sequence parallelism 2, run by each tree's own interpreter on the
same inputs, their metrics.jsonl records equal within a relative 1e-6 or the difference named.

    git -C . worktree add /tmp/rr_before <commit>
    python -m venv --system-site-packages /tmp/rr_venv
    /tmp/rr_venv/bin/pip install --no-deps -e /tmp/rr_before
    python benchmarks/rl_records_across_commits.py --before /tmp/rr_before --after . \\
        --before-python /tmp/rr_venv/bin/python --out /tmp/rr

Why: a refactor that moves how the trainers read per-token values (the frozen reference, the
old log-probs, PPO's values, DPO's reference sums) changes no figure a user sees; this tool
shows it on whole jobs, command line to metrics.jsonl, where the unit tests check the pieces.

The inputs are written once, by the `--after` tree: a tiny random GPT-2 (and a one-label reward
model of the same shape) from `zeroxla.app.tiny_checkpoints`, the bundled tiny-shakespeare SFT
examples and prompts as .jsonl. One short `zeroxla train` SFT run of the `--after` tree is the
actor of both trees' RL jobs when the `--before` tree loads it (`load_actor`); otherwise each
tree trains its own SFT run and their records are compared too. GRPO runs `--beta 0.04` on the
bundled arithmetic task, PPO on the prompts with the reward model, DPO on the bundled pairs;
3 iterations (DPO: 3 steps) each. Every job runs as `python -m zeroxla ...` in its tree's
directory (so that tree's package is the one imported, checked first), one at a time, with
8 simulated CPU devices.

Compared: every numeric field (nested dicts flattened with '/') present in both records of the
same index, timing fields (seconds, throughput) left out by name; |a - b| <= 1e-6 max(|a|, |b|)
+ 1e-9. Fields present in one tree's records only are listed, not compared. A markdown table
(job, SP, records, fields, largest relative and absolute differences, verdict) is printed and
written to OUT/table.md; the exit status is 1 on any difference past the tolerance, each one
named (job, record, field, both values).

`--varied-reward` adds a GRPO reward that differs across answers (an untrained actor scores 0 on
the arithmetic task, so the group advantages and the policy term are otherwise all zero and only
the KL term trains). `--reuse-before PREVIOUS_OUT` compares a new `--after` tree against the
`--before` runs (and inputs) of an earlier OUT without running that tree again. `--jobs` and
`--sp` choose a subset (default grpo,ppo,dpo and 1,2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

RTOL, ATOL = 1e-6, 1e-9
SETTINGS = "settings.json"              # OUT's record of the options the jobs' command lines take
MESH = "2x4"
TIMING = re.compile(r"(^|[/_])(seconds|secs?|time|timing|elapsed|throughput|wall|"
                    r"time_split|tflops|mfu)($|[/_])|_s$|_s/|per_s(ec)?\b|/s$",
                    re.IGNORECASE)
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}

INPUTS = """
import sys
from pathlib import Path
from zeroxla.app import chat_data
from zeroxla.app.tiny_checkpoints import gpt2_checkpoint
out = Path(sys.argv[1])
gpt2_checkpoint(out / "base")
gpt2_checkpoint(out / "rm", reward=True)
chat_data.write_jsonl(chat_data.shakespeare_sft(64, seed=0), out / "sft.jsonl")
chat_data.write_jsonl(chat_data.shakespeare_prompts(32, seed=2), out / "prompts.jsonl")
(out / "rr_rewards.py").write_text(
    "def distinct_chars(prompts, completions, **_):\\n"
    "    return [len(set(c)) / 6 for c in completions]\\n")
"""


@dataclass(frozen=True)
class Tree:
    """One source tree and the interpreter whose environment imports it."""

    name: str                   # "before" | "after"
    root: Path
    python: str


@dataclass
class Comparison:
    """One job's records of the two trees, compared."""

    job: str
    sp: int
    records: int = 0
    fields: int = 0
    largest: float = 0.0                                        # relative
    largest_abs: float = 0.0
    failures: list[str] = field(default_factory=list)
    only: dict[str, set[str]] = field(default_factory=dict)    # tree -> fields it alone has

    @property
    def verdict(self) -> str:
        return "equal" if not self.failures else f"DIFFER ({len(self.failures)})"


def job_env(inputs: Path) -> dict[str, str]:
    """The jobs' environment: 8 CPU devices, `inputs` (the reward module) on PYTHONPATH."""
    path = os.pathsep.join(filter(None, [str(inputs), os.environ.get("PYTHONPATH")]))
    return {**os.environ, **ENV, "PYTHONPATH": path}


def run(tree: Tree, argv: list[str], log: Path, inputs: Path) -> float:
    """Runs `python ARGV` in the tree's directory with 8 CPU devices and `inputs` (the reward
    module) on its PYTHONPATH; the wall seconds. A failed command stops the tool, naming its
    log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.call([tree.python, *argv], cwd=tree.root, stdout=f,
                               stderr=subprocess.STDOUT, env=job_env(inputs))
    seconds = time.perf_counter() - start
    print(f"  {tree.name:6s} {' '.join(argv[2:4])}: {seconds:.0f} s (log {log})", flush=True)
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        sys.exit(f"{tree.name} tree: `{' '.join(argv)}` exited {code}; {log}:\n{tail}")
    return seconds


def check_import(tree: Tree) -> None:
    """Refuses a tree whose interpreter imports zeroxla (or zeroxla.models) from elsewhere."""
    code = "import zeroxla, zeroxla.models; print(zeroxla.__file__); print(zeroxla.models.__file__)"
    paths = subprocess.run([tree.python, "-c", code], cwd=tree.root, capture_output=True,
                           text=True, check=True, env={**os.environ, **ENV}).stdout.split()
    root = tree.root.resolve()
    outside = [p for p in paths if not Path(p).resolve().is_relative_to(root)]
    if outside:
        sys.exit(f"--{tree.name}-python {tree.python} imports {outside} from outside "
                 f"--{tree.name} {root}; accepted: an environment with that tree installed")


def sft_argv(inputs: Path, out: Path) -> list[str]:
    return ["-m", "zeroxla", "train", "--init-from", str(inputs / "base"), "--data",
            str(inputs / "sft.jsonl"), "--steps", "3", "--batch-size", "8", "--seq-len", "64",
            "--warmup-steps", "1", "--learning-rate", "3e-3", "--eval-every", "3",
            "--eval-batches", "1", "--sample-tokens", "0", "--mesh", MESH, "--out", str(out),
            "--no-progress"]


def job_argv(job: str, sp: int, actor: Path, inputs: Path, out: Path,
             varied: bool = False) -> list[str]:
    """`python -m zeroxla JOB ...` for one job at sequence-parallel size `sp`; `varied` adds a
    GRPO reward that differs across answers (distinct characters / 6), so that the group
    advantages, and with them the policy term, are not all zero on an untrained actor."""
    common = ["--mesh", MESH, "--sequence-parallel-size", str(sp), "--out", str(out),
              "--no-progress"]
    if job == "grpo":
        rest = ["--actor", str(actor), "--beta", "0.04", "--iterations", "3",
                "--num-generations", "4", "--per-iteration-prompts", "4",
                "--max-completion-length", "8", "--eval-every", "3"]
        if varied:
            rest += ["--reward-funcs", "accuracy", "format", "rr_rewards:distinct_chars"]
    elif job == "ppo":
        rest = ["--actor", str(actor), "--reward", str(inputs / "rm"), "--prompts",
                str(inputs / "prompts.jsonl"), "--iterations", "3", "--per-iteration-prompts",
                "8", "--max-prompt-seq-len", "8", "--max-answer-seq-len", "12"]
    else:
        rest = ["--init-from", str(actor), "--steps", "3", "--batch-size", "8", "--seq-len",
                "96", "--eval-every", "3"]
    return ["-m", "zeroxla", job, *rest, *common]


def flat(record: dict, prefix: str = "") -> dict[str, float]:
    """The record's numeric fields (bools and strings left out), nested dicts as 'a/b'."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def compare(job: str, sp: int, before: Path, after: Path) -> Comparison:
    """The two runs' metrics.jsonl, record by record and field by field."""
    result = Comparison(job, sp, only={"before": set(), "after": set()})
    ours, theirs = ([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                     if line.strip()] for run in (before, after))
    if len(ours) != len(theirs):
        result.failures.append(f"{job} sp={sp}: {len(ours)} records (before) against "
                               f"{len(theirs)} (after)")
    for index, (a_record, b_record) in enumerate(zip(ours, theirs)):
        a, b = flat(a_record), flat(b_record)
        result.only["before"] |= {k for k in a.keys() - b.keys() if not TIMING.search(k)}
        result.only["after"] |= {k for k in b.keys() - a.keys() if not TIMING.search(k)}
        names = sorted(k for k in a.keys() & b.keys() if not TIMING.search(k))
        result.records += 1
        result.fields += len(names)
        for name in names:
            x, y = a[name], b[name]
            if math.isnan(x) and math.isnan(y):
                continue
            scale = max(abs(x), abs(y))
            relative = abs(x - y) / scale if scale else 0.0
            result.largest = max(result.largest, relative if math.isfinite(relative) else math.inf)
            result.largest_abs = max(result.largest_abs, abs(x - y))
            if not abs(x - y) <= RTOL * scale + ATOL:
                result.failures.append(f"{job} sp={sp} record {index} "
                                       f"({_where(a_record)}) {name}: before {x!r}, after {y!r}")
    return result


def _where(record: dict) -> str:
    keys = [k for k in ("iteration", "step") if k in record]
    return ", ".join(f"{k} {record[k]}" for k in keys) or "no iteration field"


def table(rows: list[Comparison]) -> str:
    lines = ["| job | SP | records compared | fields compared | largest relative difference | "
             "largest absolute difference | verdict |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.job} | {r.sp} | {r.records} | {r.fields} | {r.largest:.3g} | "
              f"{r.largest_abs:.3g} | {r.verdict} |" for r in rows]
    notes = [f"- {r.job} sp={r.sp}: fields only in the {side} tree's records: "
             f"{', '.join(sorted(names))}"
             for r in rows for side, names in r.only.items() if names]
    return "\n".join(lines + ([""] + notes if notes else []))


def actor_for(trees: dict[str, Tree], inputs: Path, out: Path,
              reuse: Path | None) -> tuple[dict[str, Path], list]:
    """Each tree's actor: the `--after` tree's SFT run for both where the `--before` tree loads
    it, else each tree's own (and then the SFT records are compared too). With `reuse` (a
    previous OUT), the `--before` tree's actor is the one its runs there used."""
    shared = out / "after" / "sft"
    run(trees["after"], sft_argv(inputs, shared), out / "logs" / "after-sft.log", inputs)
    if reuse is not None:
        own = reuse / "before" / "sft"
        if not own.exists():
            return {"before": reuse / "after" / "sft", "after": shared}, []
        return {"before": own, "after": shared}, [compare("sft", 1, own, shared)]
    probe = ["-c", "import sys; from zeroxla.app.jobs.loading import load_actor; "
             "load_actor(sys.argv[1])", str(shared)]
    loads = subprocess.run([trees["before"].python, *probe], cwd=trees["before"].root,
                           capture_output=True, text=True, env={**os.environ, **ENV})
    if loads.returncode == 0:
        print(f"  the before tree loads {shared}: one SFT actor for both trees", flush=True)
        return {"before": shared, "after": shared}, []
    print(f"  the before tree cannot load {shared} ({loads.stderr.strip().splitlines()[-1:]}); "
          "each tree trains its own SFT run", flush=True)
    own = out / "before" / "sft"
    run(trees["before"], sft_argv(inputs, own), out / "logs" / "before-sft.log", inputs)
    return {"before": own, "after": shared}, [compare("sft", 1, own, shared)]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the reference tree")
    parser.add_argument("--after", type=Path, required=True, help="the tree checked against it")
    parser.add_argument("--before-python", default="python")
    parser.add_argument("--after-python", default="python")
    parser.add_argument("--out", type=Path, required=True, help="a fresh directory")
    parser.add_argument("--jobs", default="grpo,ppo,dpo")
    parser.add_argument("--sp", default="1,2", help="sequence-parallel sizes")
    parser.add_argument("--varied-reward", action="store_true",
                        help="GRPO also rewards distinct characters (nonzero advantages)")
    parser.add_argument("--reuse-before", type=Path, metavar="PREVIOUS_OUT",
                        help="a previous --out of this tool: its inputs and the --before tree's "
                             "runs there are reused (that tree is not run again)")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} is not empty; accepted: a new or empty directory")
    if args.reuse_before is not None:
        settings = args.reuse_before / SETTINGS
        if not settings.is_file():
            parser.error(f"--reuse-before {args.reuse_before} holds no {SETTINGS}; accepted: a "
                         "previous --out of this tool")
        recorded = json.loads(settings.read_text())["varied_reward"]
        if recorded != args.varied_reward:
            parser.error(f"--reuse-before {args.reuse_before} ran with varied_reward={recorded}; "
                         f"accepted: the same --varied-reward as its runs")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    trees = {"before": Tree("before", args.before.resolve(), args.before_python),
             "after": Tree("after", args.after.resolve(), args.after_python)}
    for tree in trees.values():
        check_import(tree)
    start = time.perf_counter()
    out, reuse = args.out.resolve(), args.reuse_before and args.reuse_before.resolve()
    inputs = reuse / "inputs" if reuse else out / "inputs"
    out.mkdir(parents=True, exist_ok=True)
    (out / SETTINGS).write_text(json.dumps({"varied_reward": args.varied_reward}) + "\n")
    if not reuse:
        inputs.mkdir()
        subprocess.run([trees["after"].python, "-c", INPUTS, str(inputs)],
                       cwd=trees["after"].root, check=True, env={**os.environ, **ENV})
    actors, rows = actor_for(trees, inputs, out, reuse)
    for job in args.jobs.split(","):
        for sp in (int(p) for p in args.sp.split(",")):
            runs = {name: out / name / f"{job}-sp{sp}" for name in trees}
            if reuse and (reuse / "before" / f"{job}-sp{sp}").is_dir():
                runs["before"] = reuse / "before" / f"{job}-sp{sp}"
            for name, tree in trees.items():
                if not runs[name].exists():
                    run(tree, job_argv(job, sp, actors[name], inputs, runs[name],
                                       args.varied_reward),
                        out / "logs" / f"{name}-{job}-sp{sp}.log", inputs)
            rows.append(compare(job, sp, runs["before"], runs["after"]))
            print(table(rows[-1:]).splitlines()[2], flush=True)
    text = table(rows) + f"\n\nwall time {time.perf_counter() - start:.0f} s"
    failures = [f for r in rows for f in r.failures]
    (out / "table.md").write_text(text + "\n" + "\n".join(failures) + "\n")
    print(text)
    for failure in failures:
        print(failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
