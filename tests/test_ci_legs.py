"""The second CI leg's selection (tests/support/ci_legs.py) names tests that exist."""

from pathlib import Path

import ci_legs

ROOT = Path(__file__).resolve().parents[1]


def test_every_second_leg_file_exists():
    missing = [f for f in ci_legs.SECOND_LEG_FILES if not (ROOT / f).is_file()]
    assert not missing, missing


def test_every_test_left_to_leg_1_exists_in_a_second_leg_file_with_its_reason():
    for node_id, reason in ci_legs.LEFT_TO_LEG_1.items():
        path, name = node_id.split("::")
        function = name.split("[")[0]
        assert path in ci_legs.SECOND_LEG_FILES, node_id
        assert f"def {function}(" in (ROOT / path).read_text(), node_id
        assert reason, node_id
