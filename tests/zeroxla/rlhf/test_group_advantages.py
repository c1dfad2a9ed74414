"""Group-relative advantages (zeroxla/rlhf/grpo/group_advantages.py) of rewards that float32 cannot
carry through the std: computed in float64 and cast, they equal a float64 numpy reference; rewards
whose advantages do not fit float32 are refused, not trained on as NaN."""

import numpy as np
import pytest

from zeroxla.rlhf.grpo.group_advantages import group_advantages

G = 4


def reference(rewards, g, scale, baseline):
    """float64 numpy: reward minus the group mean (RLOO: the others' mean), over std + 1e-4."""
    r = np.asarray(rewards, np.float64).reshape(-1, g)
    base = (r.sum(1, keepdims=True) - r) / (g - 1) if baseline == "rloo" else r.mean(1)[:, None]
    centred = r - base
    if scale == "group":
        centred = centred / (r.std(1, ddof=1, keepdims=True) + 1e-4)
    elif scale == "batch":
        centred = centred / (r.std(ddof=1) + 1e-4)
    return centred.reshape(-1)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("baseline", ["grpo", "rloo"])
@pytest.mark.parametrize("rewards", [
    1e25 * np.random.default_rng(0).normal(size=4 * G),            # squares overflow float32
    1000.0 + 1e-3 * np.random.default_rng(1).normal(size=4 * G)],  # below float32's ulp at 1000
    ids=["huge", "fine"])
def test_advantages_equal_float64_numpy(rewards, scale, baseline):
    got = group_advantages(rewards, G, scale_rewards=scale, advantage=baseline)
    want = reference(rewards, G, scale, baseline)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-6, atol=0)


def test_an_equal_float64_group_has_exactly_zero_advantage():
    rewards = np.array([0.1, 0.1, 0.1, 0.7, 0.2, 0.4])             # mean(0.1 x 3) != 0.1
    for scale in ("group", "batch", "none"):
        got = group_advantages(rewards, 3, scale_rewards=scale)
        assert np.all(got[:3] == 0.0), (scale, got)


@pytest.mark.parametrize("rewards, scale", [
    ([1e300, 0.0, 0.0, 0.0], "group"),                   # beyond float32: refused, not NaN
    ([3e38, -3e38, -3e38, -3e38], "none")])             # fits float32, its advantage not
def test_rewards_whose_advantages_overflow_float32_are_refused(rewards, scale):
    with pytest.raises(ValueError, match=r"rewards from .* do not fit float32"):
        group_advantages(np.array(rewards), G, scale_rewards=scale)
