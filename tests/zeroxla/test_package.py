"""The shape of the package (STYLE.md): no import cycles between zeroxla's modules, `import zeroxla`
does not load the training application, imports follow the layers (LAYERS), no module is over
400 lines and no function over 80.

The modules are found from the files, not by importing them: pyproject.toml's
`[tool.setuptools] package-dir` says which folder each package installs from (`models/` is
`zeroxla.models`, `pallas_kernels/` is `zeroxla.pallas_kernels`).
"""

import ast
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "zeroxla"
MAX_LINES = 400
MAX_FUNCTION_LINES = 80


# ---- the import graph ----------------------------------------------------------------------------

def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Top-level package name -> its folder, from pyproject.toml's package-dir (longest first)."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    dirs = pyproject["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in dirs.items() if name.startswith(PACKAGE)}


def module_files(dirs: Mapping[str, Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of every package folder in `dirs`. A
    package's `__init__.py` is the module named after the package."""
    modules = {}
    for package, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _known_prefix(name: str, modules: Iterable[str]) -> str | None:
    """The longest module in `modules` that `name` is or lies inside (`a.b.c` -> `a.b`)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def _resolve(name: str, package: str) -> str:
    """`name` with its leading dots resolved against `package`, as Python does (one dot is
    `package` itself, each further dot one package up); an absolute name as it is."""
    level = len(name) - len(name.lstrip("."))
    if not level:
        return name
    parts = package.split(".")
    rest = name[level:]
    return ".".join(parts[:len(parts) - level + 1] + ([rest] if rest else []))


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _argument(call: ast.Call, position: int, keyword: str) -> ast.AST | None:
    if len(call.args) > position:
        return call.args[position]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def dynamic_imports(call: ast.Call, module: str, package: str,
                    import_module_names: set[str]) -> list[str]:
    """The modules a call imports by a literal name: `importlib.import_module(name, package)`
    (under any alias of importlib or of the function) and `__import__(name, globals, locals,
    fromlist, level)`, relative names resolved (a `package` argument of `__package__` or
    `__name__` is this module's own); [] for any other call, or a name computed at run time."""
    func = call.func
    attr = func.attr if isinstance(func, ast.Attribute) else None
    bare = func.id if isinstance(func, ast.Name) else None
    name = _literal(_argument(call, 0, "name"))
    if name is None:
        return []
    if attr == "import_module" or bare in import_module_names:
        if not name.startswith("."):
            return [name]
        anchor = _argument(call, 1, "package")
        own = {"__package__": package, "__name__": module}
        base = own.get(anchor.id) if isinstance(anchor, ast.Name) else _literal(anchor)
        return [] if base is None else [_resolve(name, base)]
    if attr == "__import__" or bare == "__import__":
        level = _argument(call, 4, "level")
        base = _resolve("." * (level.value if isinstance(level, ast.Constant) else 0) + name,
                        package)
        fromlist = _argument(call, 3, "fromlist")
        items = fromlist.elts if isinstance(fromlist, (ast.List, ast.Tuple)) else []
        return [base] + [f"{base}.{item}" for e in items if (item := _literal(e))]
    return []


def imports_of(module: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """The modules of `modules` that `module` imports: every `import` / `from ... import`
    statement anywhere in the file (inside functions too), relative ones resolved; `from a import
    b` is an edge to `a.b` when that is a module, else to `a`; and every import by a literal
    name through `importlib.import_module` or `__import__` (`dynamic_imports`)."""
    package = module if _is_package(path) else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    import_module_names = {"import_module"} | {
        alias.asname or alias.name for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "importlib"
        for alias in node.names if alias.name == "import_module"}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve("." * node.level + (node.module or ""), package)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        elif isinstance(node, ast.Call):
            targets = dynamic_imports(node, module, package, import_module_names)
        else:
            continue
        found |= {known for target in targets
                  if (known := _known_prefix(target, modules)) is not None}
    found.discard(module)
    return found


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """module -> the modules it imports, without a package `__init__`'s imports of its own
    submodules: those are re-exports, which run after the package object exists and so are
    not cycles in the sense that matters (a module that needs a half-initialised module)."""
    graph = {}
    for module, path in modules.items():
        edges = imports_of(module, path, modules)
        if _is_package(path):
            edges = {e for e in edges if not e.startswith(module + ".")}
        graph[module] = edges
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One shortest cycle per strongly connected component with more than one module, as a list
    of modules whose last imports the first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def strongconnect(v: str) -> None:          # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return [_shortest_cycle(graph, min(component), component) for component in components]


def _shortest_cycle(graph: Mapping[str, set[str]], start: str, within: set[str]) -> list[str]:
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        next_frontier = []
        for v in frontier:
            for w in sorted(graph[v] & within):
                if w == start:
                    return paths[v]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    next_frontier.append(w)
        frontier = next_frontier
    raise AssertionError(f"{start} is in a component but on no cycle")


def _write(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_graph_builder_on_a_small_package(tmp_path):
    """The builder itself: relative, function-level and `from pkg import submodule` imports are
    edges; an `__init__` re-exporting its submodules is not a cycle; a real cycle is found."""
    _write(tmp_path, {
        "zeroxla/__init__.py": "from zeroxla.a import f\nfrom .b import g\n",
        "zeroxla/a.py": "import zeroxla\nfrom zeroxla import sub\nimport numpy\n",
        "zeroxla/b.py": "def g():\n    from .sub import leaf\n",
        "zeroxla/sub/__init__.py": "from . import leaf\nfrom .leaf import h\n",
        "zeroxla/sub/leaf.py": "from .. import a\nfrom zeroxla.sub.leaf import h\nh = 1\n",
        "models/__init__.py": "from .gpt import GPT\n",
        "models/gpt.py": "from zeroxla.models import axes\nfrom . import GPT\n",
        "models/axes.py": "",
    })
    modules = module_files({"zeroxla": tmp_path / "zeroxla",
                            "zeroxla.models": tmp_path / "models"})
    assert sorted(modules) == ["zeroxla", "zeroxla.a", "zeroxla.b", "zeroxla.models",
                               "zeroxla.models.axes", "zeroxla.models.gpt", "zeroxla.sub",
                               "zeroxla.sub.leaf"]
    graph = import_graph(modules)
    assert graph == {
        "zeroxla": set(),                                   # re-exports dropped
        "zeroxla.a": {"zeroxla", "zeroxla.sub"},
        "zeroxla.b": {"zeroxla.sub.leaf"},                  # inside a function
        "zeroxla.sub": set(),
        "zeroxla.sub.leaf": {"zeroxla.a"},                  # `from .. import a`
        "zeroxla.models": set(),
        "zeroxla.models.gpt": {"zeroxla.models.axes", "zeroxla.models"},
        "zeroxla.models.axes": set(),
    }
    assert cycles(graph) == []
    _write(tmp_path, {"zeroxla/sub/__init__.py": "", "zeroxla/a.py": "from .sub.leaf import h\n"})
    assert cycles(import_graph(module_files({"zeroxla": tmp_path / "zeroxla"}))) == [
        ["zeroxla.a", "zeroxla.sub.leaf"]]


def test_imports_by_a_literal_name_through_importlib_or_dunder_import_are_edges(tmp_path):
    """`importlib.import_module` (however importlib or the function is bound) and `__import__`
    with a literal name are edges, relative names resolved and `fromlist` modules included, so
    an upward import cannot pass by not being an `import` statement; a name only known at run
    time is no edge."""
    _write(tmp_path, {
        "zeroxla/__init__.py": "",
        "zeroxla/a.py": "import importlib\nm = importlib.import_module('zeroxla.sub.leaf')\n",
        "zeroxla/b.py": "from importlib import import_module as load\n"
                        "def f():\n    return load('.sub', __package__)\n",
        "zeroxla/c.py": "import importlib as il\nx = il.import_module('..a', 'zeroxla.sub')\n",
        "zeroxla/d.py": "__import__('zeroxla.sub', fromlist=['leaf'])\n",
        "zeroxla/e.py": "import importlib\nname = 'zeroxla.a'\nimportlib.import_module(name)\n",
        "zeroxla/sub/__init__.py": "",
        "zeroxla/sub/leaf.py": "a = __import__('a', globals(), None, [], 2)\n",
        "zeroxla/sharding/__init__.py": "",
        "zeroxla/sharding/mesh.py": "import importlib\n"
                                    "def f():\n    importlib.import_module('zeroxla.engine')\n",
        "zeroxla/engine/__init__.py": "",
    })
    graph = import_graph(module_files({"zeroxla": tmp_path / "zeroxla"}))
    assert graph == {
        "zeroxla": set(),
        "zeroxla.a": {"zeroxla.sub.leaf"},
        "zeroxla.b": {"zeroxla.sub"},                       # '.sub' of __package__ 'zeroxla'
        "zeroxla.c": {"zeroxla.a"},                         # '..a' of 'zeroxla.sub'
        "zeroxla.d": {"zeroxla.sub", "zeroxla.sub.leaf"},   # fromlist modules too
        "zeroxla.e": set(),                                 # computed name: not readable
        "zeroxla.sub": set(),
        "zeroxla.sub.leaf": {"zeroxla.a"},                  # level 2 from zeroxla.sub.leaf
        "zeroxla.sharding": set(),
        "zeroxla.sharding.mesh": {"zeroxla.engine"},
        "zeroxla.engine": set(),
    }
    assert layer_violations(graph) == [
        "zeroxla.sharding.mesh -> zeroxla.engine (zeroxla.sharding is below zeroxla.engine)"]


def test_import_graph_has_no_cycles():
    graph = import_graph(module_files(package_dirs()))
    assert "zeroxla.analysis.hlo" in graph["zeroxla.analysis.comm_report"]   # the graph is real
    found = cycles(graph)
    assert not found, ("import cycles between zeroxla modules (imports inside functions count; "
                       "a package __init__ re-exporting its submodules does not):\n"
                       + "\n".join(" -> ".join(cycle + cycle[:1]) for cycle in found))


# ---- the layers ----------------------------------------------------------------------------------

# zeroxla's parts, bottom up (issue 23; the package guides and README's layout table say the same).
# A module may import its own part and any part of a lower layer, never a higher one; parts of one
# layer may import each other (the cycle test above still holds between modules).
LAYERS = (
    ("zeroxla.models", "zeroxla.pallas_kernels"),    # import nothing of zeroxla
    ("zeroxla.compat",),                             # what differs between JAX versions
    ("zeroxla.sharding",),                           # mesh, config, rules, plan: data only
    ("zeroxla.collectives",),
    ("zeroxla.engine",),                             # the step and its layout
    ("zeroxla.pipeline",),                           # the pipelined gradient pass
    ("zeroxla.make",),                               # make_step: chooses plain or pipelined
    ("zeroxla.checkpoint", "zeroxla.analysis", "zeroxla.inference"),
    ("zeroxla.deepspeed",),                          # DeepSpeed JSON -> typed configs
    ("zeroxla",),                                    # the public API (__init__)
    ("zeroxla.rlhf",),
    ("zeroxla.app", "zeroxla.__main__"),             # the application: nothing imports it
)
# Imports that the order alone would allow but the design rules out: the plan names bit widths
# and group sizes as data and never calls the kernels.
NEVER = {("zeroxla.sharding", "zeroxla.pallas_kernels")}


def part_of(module: str) -> str:
    """The part of LAYERS `module` belongs to (its longest listed prefix)."""
    parts = [p for layer in LAYERS for p in layer
             if module == p or (p != PACKAGE and module.startswith(p + "."))]
    return max(parts, key=len) if parts else PACKAGE


def layer_violations(graph: Mapping[str, set[str]]) -> list[str]:
    """Every import that goes up the layers or is in NEVER, as "importer -> imported (why)"."""
    level = {part: i for i, layer in enumerate(LAYERS) for part in layer}
    found = []
    for module, imported in sorted(graph.items()):
        src = part_of(module)
        for target in sorted(imported):
            dst = part_of(target)
            if dst == src:
                continue
            if level[dst] > level[src]:
                found.append(f"{module} -> {target} ({src} is below {dst})")
            elif (src, dst) in NEVER:
                found.append(f"{module} -> {target} ({src} never imports {dst})")
    return found


def test_layer_checker_names_a_planted_violation(tmp_path):
    """The checker itself, on a small package: an upward import and a NEVER import are each
    named with the importing module; downward and same-part imports pass."""
    _write(tmp_path, {
        "zeroxla/__init__.py": "",
        "zeroxla/sharding/__init__.py": "",
        "zeroxla/sharding/plan.py": "from zeroxla.sharding import mesh\n",
        "zeroxla/sharding/mesh.py": "",
        "zeroxla/engine/__init__.py": "",
        "zeroxla/engine/step.py": "from zeroxla.sharding.plan import x\nimport zeroxla.models\n",
        "models/__init__.py": "",
    })
    dirs = {"zeroxla": tmp_path / "zeroxla", "zeroxla.models": tmp_path / "models"}
    assert layer_violations(import_graph(module_files(dirs))) == []
    _write(tmp_path, {"zeroxla/sharding/mesh.py": "def f():\n    from zeroxla.engine import step\n",
                      "zeroxla/pallas_kernels/__init__.py": "",
                      "zeroxla/sharding/rules.py": "from zeroxla.pallas_kernels import q\n"})
    dirs["zeroxla.pallas_kernels"] = tmp_path / "zeroxla" / "pallas_kernels"
    assert layer_violations(import_graph(module_files(dirs))) == [
        "zeroxla.sharding.mesh -> zeroxla.engine.step (zeroxla.sharding is below zeroxla.engine)",
        "zeroxla.sharding.rules -> zeroxla.pallas_kernels "
        "(zeroxla.sharding never imports zeroxla.pallas_kernels)"]


def test_every_part_is_in_a_layer():
    """A new subpackage or top-level module must be placed in LAYERS (else it would pass as
    the public API's part)."""
    modules = module_files(package_dirs())
    parts = {".".join(m.split(".")[:2]) for m in modules if m != PACKAGE}
    listed = {p for layer in LAYERS for p in layer}
    assert parts <= listed, f"not in LAYERS: {sorted(parts - listed)}"


def test_no_import_goes_up_the_layers():
    found = layer_violations(import_graph(module_files(package_dirs())))
    assert not found, ("imports against the layers (tests/zeroxla/test_package.py LAYERS, "
                       "bottom up):\n" + "\n".join(found))


# ---- what `import zeroxla` loads -----------------------------------------------------------------

def test_import_zeroxla_does_not_load_the_training_application():
    """zeroxla.app (CLI, data, tokenizers, the train job) is an application built on the library;
    importing the library must not import it."""
    code = ("import zeroxla, sys; "
            "print(sorted(m for m in sys.modules if m.startswith('zeroxla')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=300, check=True).stdout
    loaded = ast.literal_eval(out.strip().splitlines()[-1])
    assert "zeroxla.engine.step" in loaded
    app = [m for m in loaded if m == "zeroxla.app" or m.startswith("zeroxla.app.")]
    assert not app, f"`import zeroxla` loads the training application: {app}"


# ---- module size ---------------------------------------------------------------------------------

def test_no_module_is_over_400_lines():
    sizes = {path.relative_to(ROOT): len(path.read_text().splitlines())
             for path in module_files(package_dirs()).values()}
    assert len(sizes) > 30
    over = {str(path): lines for path, lines in sorted(sizes.items()) if lines > MAX_LINES}
    # Do not raise the limit to make it pass: split the module into ones that each own one idea.
    assert not over, (f"modules over {MAX_LINES} lines (STYLE.md: small modules, each owning one "
                      "idea; split them): "
                      + ", ".join(f"{path} ({lines})" for path, lines in over.items()))


def test_no_function_is_over_80_lines():
    """Every function and method, docstring included, in at most MAX_FUNCTION_LINES lines."""
    over = []
    for path in module_files(package_dirs()).values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    over.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert not over, (f"functions over {MAX_FUNCTION_LINES} lines (split them into functions "
                      "that each do one thing): " + ", ".join(over))


def test_every_module_is_named_in_its_package_guide_and_the_readme_layout():
    """Each package's `__init__` docstring lists its modules, and the README's layout table row
    for the package names each one: a new module shows up in both, or this fails naming it."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = {line.split("`")[1].rstrip("/"): line for line in readme.splitlines()
            if line.startswith("| ") and line.count("`") >= 2}
    unlisted = []
    for init in sorted((ROOT / PACKAGE).glob("*/__init__.py")):
        guide = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        row = rows.get(f"{PACKAGE}/{init.parent.name}", "")
        for module in sorted(p.stem for p in init.parent.glob("*.py") if p.stem != "__init__"):
            if f"{module}.py" not in guide:
                unlisted.append(f"{init.parent.name}/{module}.py missing from {init}'s guide")
            if f"`{module}`" not in row:
                unlisted.append(f"{init.parent.name}/{module}.py missing from the README "
                                f"layout row of {PACKAGE}/{init.parent.name}/")
    assert not unlisted, "\n".join(unlisted)


# ---- JAX versions --------------------------------------------------------------------------------

# What choosing by the installed JAX's version looks like in code: only zeroxla.compat may do it.
VERSION_CHECKS = re.compile(r"jax_at_least\(|compat\.versions|compat import versions|"
                            r"__version__\s*[<>=!]|__version__\.split|"
                            r"metadata\.version\(\s*[\"']jax")


def test_only_compat_chooses_by_the_jax_version():
    """Every version-dependent branch lives in zeroxla.compat (its BRANCHES table lists them):
    no other module of the package compares or parses the installed JAX's version."""
    found = [f"{module}: {match.group(0)}"
             for module, path in module_files(package_dirs()).items()
             if not (module == "zeroxla.compat" or module.startswith("zeroxla.compat."))
             for match in VERSION_CHECKS.finditer(path.read_text())]
    assert not found, found


def test_every_listed_version_branch_names_a_file_that_exists():
    from zeroxla.compat import BRANCHES

    for branch in BRANCHES:
        path = branch.where.split(" ")[0]
        assert (ROOT / path).is_file(), branch
        assert branch.since > (0, 10) and branch.older and branch.newer and branch.tests, branch
