"""Package discovery only; every other setting is in pyproject.toml.

`models/` and `pallas_kernels/` install as `zeroxla.models` and `zeroxla.pallas_kernels`
(pyproject's `package-dir`). `[tool.setuptools.packages.find]` names what it finds by its folder
(`models`), not by the package it installs as, so the packages are found here: every folder
with an `__init__.py` under `zeroxla/`, `models/` and `pallas_kernels/`, none listed by hand
(tests/test_install.py checks that the wheel holds them all).
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
REMAPPED = ("models", "pallas_kernels")       # installed under zeroxla (package-dir)

setup(packages=[
    *find_packages(ROOT, include=["zeroxla", "zeroxla.*"]),
    *(f"zeroxla.{name}" for name in find_packages(
        ROOT, include=[p for top in REMAPPED for p in (top, f"{top}.*")])),
])
