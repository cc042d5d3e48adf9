"""RULER's scoring (scripts/eval/evaluate.py and scripts/eval/synthetic/constants.py), reimplemented.

Predictions are stripped and every control character (U+0000-U+001F) becomes a newline before
matching; `string_match_all` is the mean over samples of the fraction of references found in the
prediction (case-insensitive substring), x 100 and rounded to 2 places; `string_match_part` (RULER's
QA metric) counts a sample when any reference is found.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    return _CONTROL.sub("\n", prediction.strip()).strip()


def sample_match_all(prediction: str, references: Sequence[str]) -> float:
    """The fraction of `references` found in `prediction` (one sample of string_match_all)."""
    pred = prediction.lower()
    return sum(1.0 if r.lower() in pred else 0.0 for r in references) / len(references)


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    scores = [sample_match_all(p, r) for p, r in zip(predictions, references, strict=True)]
    return round(sum(scores) / len(predictions) * 100, 2)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    hits = [max(1.0 if r.lower() in p.lower() else 0.0 for r in refs)
            for p, refs in zip(predictions, references, strict=True)]
    return round(sum(hits) / len(predictions) * 100, 2)


def sample_score(prediction: str, references: Sequence[str], metric: str) -> float:
    """One sample's score under RULER's `metric`: "all" (the share of references found) or "part" (1 if any is)."""
    found = [r.lower() in prediction.lower() for r in references]
    return sum(found) / len(found) if metric == "all" else float(any(found))


METRICS = {"all": string_match_all, "part": string_match_part}

__all__ = ["METRICS", "postprocess", "sample_match_all", "sample_score", "string_match_all", "string_match_part"]
