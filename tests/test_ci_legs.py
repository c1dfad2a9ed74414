"""The second CI leg's selection (tests/support/ci_legs.py) names tests that exist, and every test
module imports on leg 2, where the dev extra installs no torch (nor peft) and `datasets` is not in
it at all."""

import ast
from pathlib import Path

import ci_legs

ROOT = Path(__file__).resolve().parents[1]


def test_every_second_leg_file_exists():
    missing = [f for f in ci_legs.SECOND_LEG_FILES if not (ROOT / f).is_file()]
    assert not missing, missing


def test_every_test_left_to_leg_1_exists_in_a_second_leg_file_with_its_reason():
    for node_id, reason in ci_legs.LEFT_TO_LEG_1.items():
        path, name = node_id.split("::")
        function = name.split("[")[0]
        assert path in ci_legs.SECOND_LEG_FILES, node_id
        assert f"def {function}(" in (ROOT / path).read_text(), node_id
        assert reason, node_id


# Packages some leg lacks (pyproject.toml's dev extra): a test module may import them only through
# `pytest.importorskip` or inside a test, or the whole file fails to collect on that leg.
NOT_ON_EVERY_LEG = frozenset({"torch", "peft", "datasets", "wandb", "mlflow"})


def module_level_imports_of(tree: ast.Module, packages) -> list[tuple[int, str]]:
    """(line, package) of each import statement in the module's own body (not in a function, a
    class, a try or an if) whose top-level package is one of `packages`."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n.split(".")[0]) for n in names if n.split(".")[0] in packages]
    return found


def test_the_import_check_names_a_planted_module_level_import():
    tree = ast.parse("import numpy\nimport torch.nn\nfrom peft import LoraConfig\n"
                     "def f():\n    import datasets\n"
                     "torch = __import__('pytest').importorskip('torch')\n")
    assert module_level_imports_of(tree, NOT_ON_EVERY_LEG) == [(2, "torch"), (3, "peft")]


def test_no_test_module_imports_a_package_some_leg_lacks_at_module_level():
    offenders = [f"{path.relative_to(ROOT)}:{line} imports {package}"
                 for path in sorted((ROOT / "tests").rglob("*.py"))
                 for line, package in module_level_imports_of(
                     ast.parse(path.read_text()), NOT_ON_EVERY_LEG)]
    assert not offenders, offenders
