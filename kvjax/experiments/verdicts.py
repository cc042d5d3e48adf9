"""How a report words a claim: from the numbers, by one rule, so no verdict says more than its evidence.

A claim is a comparison: a difference, signed so that positive goes the claim's way (the method beats
the baseline, or stays inside the claimed margin), and the standard error of that difference. The
claim **holds** where the difference is more than two standard errors above zero, **does not hold**
where it is more than two below, and is **inconclusive** in between, or where there is no standard
error at all (one sequence): a tie, or a difference inside the noise, is neither (issue 65: "does
not hold" had been written for a MAT sweep 0-2 items of 40 behind, and "holds only as a tie" for
SlimKV 1/30 against SnapKV 1/30). A claim that rests on training also says what share of the paper's
training tokens it used, when that is known: 77K tokens are not the paper's run.
"""

from __future__ import annotations

import math

HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"
SE_MULTIPLE = 2  # a difference must pass two standard errors (about 95 % two-sided) to decide a claim
# Two caches are compared at matched size where the shares of the full cache they hold differ by at most this;
# a comparison of a larger cache with a smaller one is not a comparison of the methods, so it decides nothing.
MATCHED_HELD = 0.01


def unmatched(held_a: float | None, held_b: float | None) -> str | None:
    """The words "**no verdict**, not matched (...)" for two caches holding these shares of the full cache more
    than `MATCHED_HELD` apart, or None where they are matched (or a share is unknown)."""
    if held_a is None or held_b is None or abs(held_a - held_b) <= MATCHED_HELD:
        return None
    return f"**no verdict**, not matched (KV held {held_a:.3f} against {held_b:.3f}, more than {MATCHED_HELD:g} apart)"


def verdict(diff: float, se: float | None, n: int | None = None) -> str:
    """`HOLDS`, `FAILS` or `INCONCLUSIVE` for a difference `diff` (positive: the claim's way) with standard
    error `se` (None: unknown, e.g. one sample). Zero difference with zero error is a tie, inconclusive.

    `n`, for a paired difference: with a zero standard error (every one of the n per-sample differences the same,
    e.g. 5 prompts each found by one side only) two standard errors bound nothing, and the sign test decides
    instead: n differences all on one side have probability 2^(1 - n) (two-sided) under no difference, so n >= 6
    decide at the 5 % that two standard errors stand for, and fewer are inconclusive."""
    if se is None or not math.isfinite(se) or not math.isfinite(diff):
        return INCONCLUSIVE
    if se == 0 and diff != 0 and n is not None and sign_test(n) >= SIGN_LEVEL:
        return INCONCLUSIVE
    if abs(diff) > SE_MULTIPLE * se:
        return HOLDS if diff > 0 else FAILS
    return INCONCLUSIVE


SIGN_LEVEL = 0.05  # the two-sided level two standard errors stand for


def sign_test(n: int) -> float:
    """The two-sided probability that n paired differences all fall on one side when neither side is better."""
    return min(1.0, 2 * 0.5 ** n)


def all_of(verdicts: list[str]) -> str:
    """A claim made at every point of a sweep: it fails where one point fails, holds where every point holds,
    and is inconclusive otherwise (one undecided point leaves "at every point" undecided)."""
    if FAILS in verdicts:
        return FAILS
    return HOLDS if verdicts and all(v == HOLDS for v in verdicts) else INCONCLUSIVE


def trained(measured: str, share: float | None) -> str:
    """A training-based claim, bold: the measured comparison by the rule, and the paper's claim inconclusive unless the
    variant had the paper's training (`share` of its tokens; None: not known). A model trained on a sliver of it tests
    the sliver, not the method."""
    if share is not None and share >= 1:
        return f"**{measured}**"
    return f"**{measured}** for this variant; the paper's claim, **{INCONCLUSIVE}**"


def binomial_se(p1: float, p2: float, n: int) -> float:
    """The standard error of the difference of two means of n independent scores in [0, 1] each (p1 and p2:
    the means), the two unpaired. Exact for accuracies; for any score in [0, 1] (F1, ROUGE) an upper bound,
    as a score of mean p has variance at most p (1 - p); so the rule errs towards "inconclusive"."""
    var = lambda p: min(max(p, 0.0), 1.0) * (1 - min(max(p, 0.0), 1.0))  # noqa: E731
    return math.sqrt((var(p1) + var(p2)) / n)


def paired_se(diffs: list[float]) -> float | None:
    """The standard error of the mean of per-sample differences (both sides read the same samples, so each
    sample's own difficulty cancels); None for fewer than two samples."""
    k = len(diffs)
    if k < 2:
        return None
    mean = sum(diffs) / k
    return math.sqrt(sum((d - mean) ** 2 for d in diffs) / (k - 1) / k)


def evidence(diff: float, se: float | None, *, paired: bool, n: int, of: str = "items",
             training_share: float | None = None, digits: int = 3) -> str:
    """The numbers a verdict rests on, in words: the difference, its standard error and how it was taken, and
    (a training-based claim) the share of the paper's training tokens used."""
    of = of.removesuffix("s") if n == 1 else of
    how = f"paired over {n} {of}" if paired else f"unpaired, {n} {of} each"
    if se is None:
        text = f"difference {diff:+.{digits}f}, no standard error ({how})"
    elif se == 0 and diff != 0 and paired:
        text = (f"difference {diff:+.{digits}f}, s.e. 0 ({how}): every difference the same, decided by the sign "
                f"test, p = {sign_test(n):.2g} (two-sided; decides below {SIGN_LEVEL:g})")
    else:
        size = f"{abs(diff) / se:.1f} s.e., " if se > 0 else ""
        text = f"difference {diff:+.{digits}f}, s.e. {se:.{digits}f} ({how}): {size}decided beyond {SE_MULTIPLE} s.e."
    if training_share is not None:
        text += f"; trained on {training_share:.2g} of the paper's training tokens (1/{1 / training_share:,.0f})"
    return text



def paired_gap(better: dict, worse: dict) -> tuple[float, float | None, int]:
    """(mean difference, its paired standard error, samples) of two sides' per-sample scores, `{sample key:
    score}` each. The two must hold the same samples: a comparison over different samples is not paired, and
    a missing record is not a zero."""
    if better.keys() != worse.keys():
        only = sorted(map(str, better.keys() ^ worse.keys()))
        raise ValueError(f"paired_gap: the two sides read different samples ({len(only)} unmatched, e.g. {only[0]})")
    diffs = [better[k] - worse[k] for k in better]
    if not diffs:
        raise ValueError("paired_gap: no samples")
    return sum(diffs) / len(diffs), paired_se(diffs), len(diffs)
