"""Issue 14: `pip install .` puts `models/` and `pallas_kernels/` under the `zeroxla` namespace.

A regular (non-editable) install into a fresh virtual environment, from a copy of the source
tree (so the checkout is neither built in nor importable): afterwards `zeroxla.models` and
`zeroxla.pallas_kernels` import from the installed package, a user's own `models.py` and
`pallas_kernels.py` are what `import models` / `import pallas_kernels` find, and from an empty
directory neither plain name imports at all.

The venv sees the system site-packages for the dependencies (jax, flax, ...) and for pip and
setuptools themselves (`--without-pip`: the venv's bundled setuptools is too old to build a
wheel); zeroxla is installed `--no-deps --no-build-isolation`, so the test needs no network,
and it comes from the venv's own site-packages.
"""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "zeroxla", "models", "pallas_kernels")


def _run(args, cwd, env=None):
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def installed_python(tmp_path_factory):
    """The python of a fresh venv holding a regular install of a copy of this checkout."""
    base = tmp_path_factory.mktemp("install")
    source = base / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, source / name, ignore=ignore)
        else:
            shutil.copy(src, source / name)
    venv = base / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], cwd=base)
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
          str(source)], cwd=base)
    return python, venv


def _env():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)          # pytest's `pythonpath` must not leak into the child
    env.pop("XLA_FLAGS", None)           # one CPU device, as on a user's laptop: make_mesh(1, 1)
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.mark.slow
def test_installed_package_leaves_models_and_pallas_kernels_to_the_user(installed_python,
                                                                        tmp_path):
    python, venv = installed_python
    user = tmp_path / "user_project"
    user.mkdir()
    (user / "models.py").write_text("OWNER = 'user models'\n")
    (user / "pallas_kernels.py").write_text("OWNER = 'user kernels'\n")
    script = textwrap.dedent(f"""
        import zeroxla, zeroxla.models, zeroxla.pallas_kernels
        import models, pallas_kernels
        zeroxla.make_mesh(1, 1)
        venv = {str(venv)!r}
        for module in (zeroxla, zeroxla.models, zeroxla.pallas_kernels):
            assert module.__file__.startswith(venv), (module.__name__, module.__file__)
        assert models.OWNER == 'user models', models.__file__
        assert pallas_kernels.OWNER == 'user kernels', pallas_kernels.__file__
        assert hasattr(zeroxla.models, 'GPT'), dir(zeroxla.models)
        print('ok')
    """)
    assert _run([str(python), "-c", script], cwd=user, env=_env()).strip().endswith("ok")


@pytest.mark.slow
def test_plain_models_does_not_import_from_an_empty_directory(installed_python, tmp_path):
    python, _ = installed_python
    for name in ("models", "pallas_kernels"):
        result = subprocess.run([str(python), "-c", f"import {name}"], cwd=tmp_path, env=_env(),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode != 0, f"`import {name}` worked: {result.stdout}"
        assert f"No module named '{name}'" in result.stderr, result.stderr
