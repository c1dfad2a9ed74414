"""The Python garbage collector's settings in every test process (tests/conftest.py applies them).

A pytest-xdist worker imports every test module when it collects, torch and transformers among
them, and then traces a few hundred programs: each trace makes and drops many container
objects, and each of CPython's full collections walks every object alive, the imported
libraries' included. Measured with `gc.callbacks` on pipelined tests (test_storage.py and
test_weight_split.py, torch imported as in a worker): 7.5 of 84 CPU-seconds in the collector at
CPython's defaults, 2.9 with both settings below (5.1 freezing alone, 4.8 with the thresholds
alone); test_parity.py: 5.4 -> 2.9 of 91.

- `gc.freeze()` once collection has imported everything: what exists then (modules, test
  parameters) lives as long as the process and is no longer walked by each full collection.
- `gc.set_threshold(*THRESHOLDS)`: collect the youngest generation after 20,000 net container
  allocations instead of 700, and the older ones 20 times less often than the one below
  instead of 10.

Neither changes what is collected, only when: cyclic garbage (programs a test dropped) is still
freed, and a full collection runs whenever a worker drops its compiled programs
(tests/support/program_release.py).
"""

import gc

THRESHOLDS = (20_000, 20, 20)


def use_test_thresholds() -> None:
    """The collector's thresholds for a test process (at conftest import)."""
    gc.set_threshold(*THRESHOLDS)


def freeze_imported() -> None:
    """Everything alive now (after collection) is left out of later collections."""
    gc.collect()
    gc.freeze()
