"""The shape issue 50 gave the application, read from the source (no program is built):

- run-directory claims and clean-ups, and the loop on stop signals, live in the runner
  (`zeroxla/app/run/`) alone (and `zeroxla launch`'s supervisor, `launch.py`, which forwards a
  stop signal to the processes it started: no job, no run directory);
- a job file holds its algorithm: no run directory, signal, metrics or summary file handling, no
  checkpoint save or restore (the runner's), no parallel layout of its own (meshes, shardings
  and collectives are the engine's: the job asks for them through its options), and no import
  of another job (`loading` is shared). What a job file may do is checked, not its length;
- the runner imports no job; argparse is called in two places only: the option table
  (`run/options.py`) and the commands that are no jobs (`cli.py`: export, generate, launch).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[4] / "zeroxla" / "app"
JOBS = {"dpo", "grpo", "ppo", "reward", "train", "generate"}        # not `loading`: shared
JOB_FILES = sorted([*(APP / "jobs" / f"{job}.py" for job in JOBS - {"train"}),
                    APP / "jobs" / "train" / "job.py"])
# What only the runner does: claim or clean a run directory, wait for stop signals, write the
# run's records, save and restore checkpoints (`checkpoint.save`, `checkpoint.restore`).
RUNNERS_OWN = {"claim", "removed_unless_saved", "rmtree", "stop_requests", "signal", "kill",
               "write_metrics", "read_metrics", "checkpoint.save", "checkpoint.restore"}
# What only the engine does: lay out arrays over a mesh and move them between devices.
ENGINES_OWN = {"shard_map", "Mesh", "NamedSharding", "PartitionSpec", "psum", "psum_scatter",
               "all_gather", "all_to_all", "ppermute", "device_put"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _names(tree: ast.Module) -> set[str]:
    """Every name and attribute the module's code uses, and every module it imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
            if isinstance(node.value, ast.Name):
                names.add(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.name for alias in node.names)
    return names


def _imports(tree: ast.Module) -> set[str]:
    """The dotted modules the code imports (`from a.b import c` gives a.b and a.b.c)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _job_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[:3] == ["zeroxla", "app", "jobs"] and len(parts) > 3 and parts[3] in JOBS:
        return parts[3]
    return None


@pytest.mark.parametrize("path", JOB_FILES, ids=lambda p: p.relative_to(APP).as_posix())
def test_a_job_file_holds_its_algorithm_alone(path):
    tree = _tree(path)
    assert not RUNNERS_OWN & _names(tree), (path, sorted(RUNNERS_OWN & _names(tree)))
    assert not ENGINES_OWN & _names(tree), (path, sorted(ENGINES_OWN & _names(tree)))
    own = path.stem if path.parent.name == "jobs" else "train"
    others = {m for m in _imports(tree) if _job_of(m) not in (None, own)}
    assert not others, (path, sorted(others))


def test_no_job_imports_another_and_the_runner_imports_none():
    for path in sorted(APP.rglob("*.py")):
        relative = path.relative_to(APP).parts
        own = relative[1].removesuffix(".py") if relative[0] == "jobs" else None
        jobs = {_job_of(m) for m in _imports(_tree(path))} - {None, own}
        if relative[0] == "jobs" and own != "generate":
            assert not jobs, (path, jobs)
        if relative[0] == "run":
            assert not any(m.startswith("zeroxla.app.jobs") for m in _imports(_tree(path))), path


def test_run_directories_and_stop_signals_are_the_runners_alone():
    claims, waits, parsers = set(), set(), set()
    for path in sorted(APP.rglob("*.py")):
        names, relative = _names(_tree(path)), path.relative_to(APP).as_posix()
        if names & {"claim", "removed_unless_saved", "rmtree"}:
            claims.add(relative)
        if "stop_requests" in names and relative != "interrupt.py":
            waits.add(relative)
        if "add_argument" in names:
            parsers.add(relative)
    assert claims == {"run/rundir.py", "run/runner.py"}
    assert waits == {"run/runner.py", "launch.py"}
    assert parsers == {"cli.py", "run/options.py"}
