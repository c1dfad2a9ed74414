"""How a lower-precision run (bf16, fp16) tracks the float32 single-device reference
(`reference.train_single_device`), beside `reference.distance_over_travelled`.

16-bit compute adds rounding noise to every gradient, in no particular direction: it moves the
parameters off the reference's path (the distance) but hardly changes how far they travel. A
systematic error does the opposite: a gradient scaled by 1.01 travels 1% further. Measured on
gpt-tiny, SGD 0.5, 3 steps: bf16's noise puts the distance at 0.6% of the travel and the travel
ratio within 2e-4 of 1; a 1.01 gradient scale moves the distance only to 1.0% but the ratio to
1.005. So a test asserts both.
"""

import numpy as np


def travel_ratio(got, expected, initial):
    """|got - initial| / |expected - initial| over all parameters (flat dicts of arrays, same
    keys): how far a run travelled, as a fraction of how far the reference travelled."""
    assert got.keys() == expected.keys() == initial.keys()
    got_travel = np.sqrt(sum(np.sum((got[p] - initial[p]) ** 2.0) for p in got))
    travelled = np.sqrt(sum(np.sum((expected[p] - initial[p]) ** 2.0) for p in expected))
    return float(got_travel / travelled)
