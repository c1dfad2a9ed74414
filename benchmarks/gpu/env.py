"""The device run's facts: device, versions (jax, jaxlib, flax, optax, cuDNN), where zeroxla
was imported from, and which attention route "auto" takes for bf16 GPT-2 / Qwen3 shapes.

    python benchmarks/gpu/env.py
"""

from __future__ import annotations

import jax

import common
import zeroxla
from zeroxla.models import attention as dispatch


def main() -> None:
    facts = common.device_facts()
    facts["zeroxla_from"] = zeroxla.__file__
    facts["models_from"] = dispatch.__file__
    for name, heads, head_dim in (("gpt2", 12, 64), ("qwen3", 16, 128)):
        q = jax.ShapeDtypeStruct((1, 1024, heads, head_dim), jax.numpy.bfloat16)
        facts[f"auto_route_{name}_bf16"] = dispatch.choose(q, q, q)
        segments = jax.ShapeDtypeStruct((1, 1024), jax.numpy.int32)
        facts[f"auto_route_{name}_bf16_packed"] = dispatch.choose(q, q, q, segment_ids=segments)
    common.record("env", **facts)


if __name__ == "__main__":
    main()
