"""The installed JAX's version, read once, for the modules of `zeroxla.compat` alone.

Nothing outside `zeroxla.compat` (and the table of `zeroxla.compat.BRANCHES`) asks which JAX it
runs on: an algorithm calls the concern's function, and the concern's module chooses.
"""

from __future__ import annotations

import jax

# (major, minor) of jax, e.g. (0, 10) or (0, 12).
JAX: tuple[int, int] = tuple(int(part) for part in jax.__version__.split(".")[:2])  # type: ignore[assignment]


def jax_at_least(major: int, minor: int) -> bool:
    """Whether the installed jax is `major.minor` or newer."""
    return JAX >= (major, minor)


__all__ = ["JAX", "jax_at_least"]
