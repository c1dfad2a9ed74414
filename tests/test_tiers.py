"""The unit-test list (tests/support/tiers.py) names files that exist and build no program."""

import ast
from pathlib import Path

import tiers

ROOT = Path(__file__).resolve().parents[1]


def program_builder_calls(source: str) -> list[str]:
    """`name (line n)` for each call in `source` of a name in tiers.PROGRAM_BUILDERS, called bare
    (`make_step(...)`) or as an attribute (`zeroxla.make_step(...)`, `jax.jit(...)`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in tiers.PROGRAM_BUILDERS:
                found.append(f"{name} (line {node.lineno})")
    return found


def test_every_unit_file_exists_and_builds_no_program():
    problems = []
    for path in tiers.UNIT_FILES:
        file = ROOT / path
        if not file.is_file():
            problems.append(f"{path}: no such file")
            continue
        problems += [f"{path}: calls {call}"
                     for call in program_builder_calls(file.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)


def test_the_check_names_a_planted_program():
    planted = "import zeroxla\nstep = zeroxla.make_step(model, mesh)\nf = jax.jit(g)\n"
    assert program_builder_calls(planted) == ["make_step (line 2)", "jit (line 3)"]
    assert program_builder_calls("config = ZeroConfig(stage=3)\n") == []
