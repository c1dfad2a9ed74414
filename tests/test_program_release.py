"""The worker's rule for dropping compiled programs (tests/support/program_release.py): kept
while the process holds at most the limit's memory maps, dropped (a jitted function compiles
again) above it, and always where the count cannot be read."""

import jax
import jax.numpy as jnp
import pytest

import program_release


def _compiles(fn, x):
    """XLA compile requests `fn(x)` makes."""
    events = []
    listener = (lambda event, *_, **__: events.append(event)
                if event == "/jax/core/compile/backend_compile_duration" else None)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.block_until_ready(fn(x))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return len(events)


def test_the_rule_counts_this_process_maps_and_drops_only_above_the_limit():
    count = program_release.map_count()
    assert count is not None and count > 0          # Linux: /proc/self/maps is readable
    assert not program_release.crowded(count, limit=count)
    assert program_release.crowded(count + 1, limit=count)
    assert program_release.crowded(None, limit=10 ** 9)      # cannot tell: drop
    assert not program_release.release_if_crowded(limit=10 ** 9)


@pytest.mark.slow    # it drops every program the worker holds: the next file compiles again
def test_programs_survive_under_the_limit_and_are_dropped_over_it():
    fn = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
    x = jnp.arange(7.0)
    assert _compiles(fn, x) == 1
    assert not program_release.release_if_crowded(limit=10 ** 9)
    assert _compiles(fn, x) == 0                    # the program was kept
    assert program_release.release_if_crowded(limit=0)
    assert _compiles(fn, x) == 1                    # dropped: compiled again
