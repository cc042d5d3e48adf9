"""The one rule that words every verdict of the report (kvjax.experiments.verdicts), on hand-computed cases."""

from __future__ import annotations

import math

import pytest

from kvjax.experiments import verdicts
from kvjax.experiments.verdicts import FAILS, HOLDS, INCONCLUSIVE, all_of, binomial_se, evidence, paired_se, verdict


@pytest.mark.parametrize("diff, se, said", [
    (0.201, 0.1, HOLDS),           # just above 2 s.e. (0.2)
    (0.199, 0.1, INCONCLUSIVE),    # just below
    (0.2, 0.1, INCONCLUSIVE),      # exactly 2 s.e. is not beyond it
    (-0.201, 0.1, FAILS),          # just beyond, the other way
    (-0.199, 0.1, INCONCLUSIVE),
    (0.0, 0.05, INCONCLUSIVE),     # a tie
    (0.0, 0.0, INCONCLUSIVE),      # a tie with no spread at all (both 0 of 30)
    (0.01, 0.0, HOLDS),            # no spread, every sample the claim's way
    (-0.01, 0.0, FAILS),
    (5.0, None, INCONCLUSIVE),     # no standard error (one sequence): no verdict, however large
    (math.nan, 0.1, INCONCLUSIVE),
    (0.1, math.inf, INCONCLUSIVE),
])
def test_reliability_a_claim_holds_or_fails_only_beyond_two_standard_errors(diff, se, said):
    assert verdict(diff, se) == said


def test_reliability_the_issue_65_verdicts_by_the_rule():
    # Attention-Gate against StreamingLLM on the 20 clean windows: the gates lose 0.062 more, s.e. 0.013
    # (paired): 4.8 s.e. against the claim that they lose less
    assert verdict(-0.062, 0.013) == FAILS
    # MAT's sweep at 25 %: 21 of 40 against StreamingLLM's 23 of 40; unpaired binomial s.e. by hand
    # sqrt((0.525 x 0.475 + 0.575 x 0.425) / 40) = sqrt(0.4937 / 40) = 0.1111: 0.45 s.e.
    se = binomial_se(0.525, 0.575, 40)
    assert se == pytest.approx(0.111102, abs=1e-6) and verdict(0.525 - 0.575, se) == INCONCLUSIVE
    # SlimKV 1 of 30 against SnapKV 1 of 30: a tie
    assert verdict(0.0, binomial_se(1 / 30, 1 / 30, 30)) == INCONCLUSIVE


def test_reliability_standard_errors_by_hand():
    # sqrt((0.25 + 0.1875) / 40) = sqrt(0.0109375)
    assert binomial_se(0.5, 0.25, 40) == pytest.approx(0.1045825, abs=1e-7)
    assert binomial_se(0.0, 1.0, 10) == 0.0
    # differences 1, 0, 0, 1: mean 0.5, sample variance 1 / 3, s.e. sqrt(1 / 12)
    assert paired_se([1.0, 0.0, 0.0, 1.0]) == pytest.approx(0.2886751, abs=1e-7)
    assert paired_se([0.3]) is None and paired_se([]) is None


def test_reliability_a_sweep_holds_only_where_every_point_holds():
    assert all_of([HOLDS, HOLDS]) == HOLDS
    assert all_of([HOLDS, INCONCLUSIVE]) == INCONCLUSIVE
    assert all_of([INCONCLUSIVE, FAILS, HOLDS]) == FAILS
    assert all_of([]) == INCONCLUSIVE


def test_reliability_the_evidence_names_the_numbers_and_the_training_share():
    assert evidence(0.059, 0.012, paired=True, n=32, of="windows", training_share=1 / 70) == (
        "difference +0.059, s.e. 0.012 (paired over 32 windows): 4.9 s.e., decided beyond 2 s.e.; "
        "trained on 0.014 of the paper's training tokens (1/70)")
    assert evidence(0.0, 0.0, paired=False, n=30) == \
        "difference +0.000, s.e. 0.000 (unpaired, 30 items each): decided beyond 2 s.e."
    assert evidence(0.01, None, paired=True, n=1, of="sequences") == \
        "difference +0.010, no standard error (paired over 1 sequence)"


def test_reliability_a_zero_paired_error_is_decided_by_the_sign_test():
    # 5 prompts, each found by one side only: every difference +1, s.e. 0; under no difference all five on one
    # side has probability 2 x 2^-5 = 0.0625 (two-sided): not below 0.05, so inconclusive; six: 0.03125, holds
    assert verdicts.sign_test(5) == 0.0625 and verdicts.sign_test(6) == 0.03125
    assert verdicts.verdict(1.0, 0.0, 5) == verdicts.INCONCLUSIVE
    assert verdicts.verdict(1.0, 0.0, 6) == verdicts.HOLDS and verdicts.verdict(-1.0, 0.0, 6) == verdicts.FAILS
    assert verdicts.verdict(0.0, 0.0, 30) == verdicts.INCONCLUSIVE  # a tie stays a tie
    text = verdicts.evidence(1.0, 0.0, paired=True, n=5, of="prompts")
    assert "every difference the same, decided by the sign test, p = 0.062" in text
