"""The adaptive width: drafter confidences are calibrated by the keep rates actually measured."""

from lucebox.speculative.width import WidthPolicy


def test_confidence_is_calibrated_by_measured_keep_rates():
    policy = WidthPolicy(15, {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4})
    beliefs = [0.3] * 7  # an underconfident drafter: says 0.3, is always right
    before = policy.choose(beliefs, 7, 7)
    for _ in range(60):
        policy.record(8, 1.2, 1.2, 8, proposed=True, confidence=beliefs)
    assert policy.calibration > 2.5
    assert policy.choose(beliefs, 7, 7) == 7 > before


def test_overconfident_drafter_is_trimmed():
    policy = WidthPolicy(15, {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4})
    beliefs = [0.95] * 7  # says 0.95, the first draft is always rejected
    assert policy.choose(beliefs, 7, 7) == 7
    for _ in range(60):
        policy.record(1, 1.2, 1.2, 8, proposed=True, confidence=beliefs)
    assert policy.calibration < 0.2
    assert policy.choose(beliefs, 7, 7) < 3
