"""The package as people install it (issues 14 and 20).

A wheel is built from a copy of the source tree (so the checkout is neither built in nor
importable), offline: `pip wheel --no-deps --no-build-isolation` with this environment's own
setuptools (>= 70.1, in `.[dev]`, builds wheels without the `wheel` package). Then:

* the wheel holds every package of the checkout (every `__init__.py` under `zeroxla/`, and
  `models/` and `pallas_kernels/` as `zeroxla.models` and `zeroxla.pallas_kernels`), every
  module, and the package data (`zeroxla/app/assets/*.txt.gz`);
* installed (`pip install --target`, a regular, non-editable install) and put first on the path
  of a child interpreter, `zeroxla.models` and `zeroxla.pallas_kernels` import from the install,
  a user's own `models.py` and `pallas_kernels.py` are what `import models` / `import
  pallas_kernels` find, and from an empty directory neither plain name imports at all.

The child is this interpreter (`sys.executable`) with the install on `PYTHONPATH`, which comes
before site-packages: its dependencies (jax, flax, ...) are this environment's, whether that is
a virtualenv or not. (A nested `venv --system-site-packages` would see the base interpreter's
site-packages instead of a virtualenv's, without its setuptools or jax.)
"""

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "zeroxla", "models", "pallas_kernels")
# Folders installed under another name (pyproject.toml's package-dir).
INSTALLED_AS = {"zeroxla": "zeroxla", "models": "zeroxla/models",
                "pallas_kernels": "zeroxla/pallas_kernels"}
PACKAGE_DATA = ("zeroxla/app/assets/*.txt.gz",)


def _run(args, cwd, env=None):
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _setuptools_builds_wheels() -> bool:
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    release = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    return release >= (70, 1) or importlib.util.find_spec("wheel") is not None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel built offline from a copy of this checkout."""
    if not _setuptools_builds_wheels():
        pytest.fail("building the wheel offline needs setuptools>=70.1 (or the `wheel` "
                    "package) in this environment; `pip install -e '.[dev]'` installs it")
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, source / name, ignore=ignore)
        else:
            shutil.copy(src, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", str(base / "dist"), str(source)], cwd=base)
    built = sorted((base / "dist").glob("zeroxla-*.whl"))
    assert len(built) == 1, built
    return built[0]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """A directory holding a regular install of the wheel (nothing else)."""
    target = tmp_path_factory.mktemp("site")
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
          "--target", str(target), str(wheel)], cwd=target)
    return target


def _env(installed):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(installed)   # before site-packages (and a checkout's editable hook)
    env.pop("XLA_FLAGS", None)           # one CPU device, as on a user's laptop: make_mesh(1, 1)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _expected_files():
    """Every module of every package of the checkout (a folder with an `__init__.py`) and every
    package-data file, by its path in the wheel."""
    expected = set()
    for folder, installed_as in INSTALLED_AS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            expected |= {f"{installed_as}/{module.relative_to(ROOT / folder).as_posix()}"
                         for module in init.parent.glob("*.py")}
    for pattern in PACKAGE_DATA:
        expected |= {path.relative_to(ROOT).as_posix() for path in ROOT.glob(pattern)}
    return expected


def test_installing_keeps_the_jax_that_is_there(wheel, tmp_path):
    """`pip install zeroxla` where a JAX in its range is installed (jax 0.10 on Python 3.11,
    0.12 on the second CI leg's 3.12) installs zeroxla alone: no JAX downgraded with its CUDA
    plugin, nothing else replaced. pip's own resolver decides, offline (`--no-index`: nothing
    but this environment to choose from), in a dry run that reports what it would install."""
    report = tmp_path / "report.json"
    _run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--no-index",
          "--report", str(report), str(wheel)], cwd=tmp_path)
    installs = {item["metadata"]["name"]: item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    assert installs == {"zeroxla": importlib.metadata.version("zeroxla")}, installs
    jax_version = importlib.metadata.version("jax")
    requirement = next(r for r in importlib.metadata.requires("zeroxla")
                       if r.startswith("jax") and r[3] in "<>=!~ ")
    print(f"kept jax {jax_version} (zeroxla requires {requirement})")


def test_wheel_holds_every_package_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = _expected_files()
    # The packages the checkout has today, at least (a new one is found by the glob above).
    assert {"zeroxla/__init__.py", "zeroxla/rlhf/__init__.py", "zeroxla/models/__init__.py",
            "zeroxla/pallas_kernels/__init__.py"} <= expected
    assert any(name.endswith(".txt.gz") for name in expected)
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {missing}"
    # Nothing installs at the top level but zeroxla (no `models` or `pallas_kernels`).
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"zeroxla"}, tops


@pytest.mark.slow
def test_installed_package_leaves_models_and_pallas_kernels_to_the_user(installed, tmp_path):
    user = tmp_path / "user_project"
    user.mkdir()
    (user / "models.py").write_text("OWNER = 'user models'\n")
    (user / "pallas_kernels.py").write_text("OWNER = 'user kernels'\n")
    script = textwrap.dedent(f"""
        import zeroxla, zeroxla.models, zeroxla.pallas_kernels, zeroxla.rlhf
        import models, pallas_kernels
        zeroxla.make_mesh(1, 1)
        site = {str(installed)!r}
        for module in (zeroxla, zeroxla.models, zeroxla.pallas_kernels, zeroxla.rlhf):
            assert module.__file__.startswith(site), (module.__name__, module.__file__)
        assert models.OWNER == 'user models', models.__file__
        assert pallas_kernels.OWNER == 'user kernels', pallas_kernels.__file__
        assert hasattr(zeroxla.models, 'GPT'), dir(zeroxla.models)
        print('ok')
    """)
    out = _run([sys.executable, "-c", script], cwd=user, env=_env(installed))
    assert out.strip().endswith("ok")


@pytest.mark.slow
def test_plain_models_does_not_import_from_an_empty_directory(installed, tmp_path):
    for name in ("models", "pallas_kernels"):
        result = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path,
                                env=_env(installed), capture_output=True, text=True,
                                timeout=120)
        assert result.returncode != 0, f"`import {name}` worked: {result.stdout}"
        assert f"No module named '{name}'" in result.stderr, result.stderr
