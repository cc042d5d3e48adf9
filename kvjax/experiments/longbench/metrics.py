"""LongBench v1's metrics, reimplemented to give the official `metrics.py` numbers exactly.

Each metric is `metric(prediction, ground_truth, all_classes=...) -> float` in [0, 1]; `score`
applies the official `scorer` rules (first-line cut for trec/triviaqa/samsum/lsht, max over the
ground truths, `round(100 * mean, 2)`), `score_e` the LongBench-E length buckets.

Two dependencies of the official code are reproduced rather than imported:
* `rouge` (pltrdy, `Rouge().get_scores(..., avg=True)["rouge-l"]["f"]`): sentences split on ".",
  summary-level union LCS over *sets* of words (that package's default `exclusive=True`), LCS
  traced back with its tie-breaking; an empty hypothesis or reference raises there and scores 0.
* `fuzzywuzzy.fuzz.ratio` without python-Levenshtein (LongBench's requirements do not list it),
  i.e. `difflib.SequenceMatcher(None, a, b).ratio()`, 100 for equal strings, 0 if one is empty,
  rounded to an integer.
jieba (the zh variants) is imported when first needed.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from kvjax.errors import InvalidInput

FIRST_LINE_DATASETS = ("trec", "triviaqa", "samsum", "lsht")
ZH_PUNCTUATION = ("！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿"
                  "–—‘’‛“”„‟…‧﹏.")


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def normalize_zh_answer(s: str) -> str:
    punct = set(string.punctuation + ZH_PUNCTUATION)
    return "".join("".join(ch for ch in s.lower() if ch not in punct).split())


def _cut(text: str) -> list[str]:
    import jieba

    return list(jieba.cut(text, cut_all=False))


def f1_tokens(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
    return f1_tokens(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **_) -> float:
    def tokens(text):
        return [t for t in (normalize_zh_answer(w) for w in _cut(text)) if t]

    return f1_tokens(tokens(prediction), tokens(ground_truth))


# LongBench's eval.py scores a summary 0 when the `rouge` package fails on it, and rouge 1.0.1 traces
# each sentence pair's LCS back recursively, one Python frame per move: from eval.py's call depth
# (CPython 3.11, recursion limit 1000) a traceback of more than 989 moves overflows the stack
# (measured: 990 matching words pass, and a pair of 989 distinct words plus one shared fails). Summaries
# with such a sentence (vcsum's and dureader's Chinese text, which has no "." to split it) are scored
# 0 as the official script scores them; a caller deeper in the stack would fail a few moves sooner.
OFFICIAL_LCS_MOVES = 989


class OfficialRougeFailure(InvalidInput):
    """Where LongBench's official script gets 0 from the `rouge` package's RecursionError."""


def _lcs_words(ref: list[str], hyp: list[str]) -> list[str]:
    """The words of `ref` on one longest common subsequence with `hyp`, traced back as the `rouge`
    package does (diagonal on a match, else up when strictly longer, else left); iterative, but a
    traceback longer than the package's recursion survives raises `OfficialRougeFailure`."""
    n, m = len(ref), len(hyp)
    # Plain lists: this double loop runs per sentence pair of every summary, and numpy scalar
    # indexing is several times slower than list indexing in pure Python.
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        row, prev = table[i], table[i - 1]
        for j in range(1, m + 1):
            row[j] = prev[j - 1] + 1 if ref[i - 1] == hyp[j - 1] else max(prev[j], row[j - 1])
    out, i, j, moves = [], n, m, 0
    while i > 0 and j > 0:
        moves += 1
        if moves > OFFICIAL_LCS_MOVES:
            raise OfficialRougeFailure(f"the LCS traceback of a {n}- and a {m}-word sentence takes more than "
                                       f"{OFFICIAL_LCS_MOVES} moves, where the official rouge recursion fails")
        if ref[i - 1] == hyp[j - 1]:
            out.append(ref[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return out[::-1]


def _sentences(text: str) -> list[str]:
    return [" ".join(s.split()) for s in text.split(".") if len(s) > 0]


def rouge_l_f(prediction: str, ground_truth: str) -> float:
    """pltrdy `rouge`'s summary-level ROUGE-L F; raises ValueError where that package raises."""
    hyp, ref = _sentences(prediction), _sentences(ground_truth)
    if not hyp:
        raise InvalidInput("Hypothesis is empty.")
    if not ref:
        raise InvalidInput("Reference is empty.")
    words = lambda sents: [w for s in sents for w in s.split(" ")]  # noqa: E731 - "" is a word there too
    m, n = len(set(words(ref))), len(set(words(hyp)))
    union: set[str] = set()
    for r in ref:
        for h in hyp:
            union |= set(_lcs_words(r.split(" "), h.split(" ")))
    recall, precision = len(union) / m, len(union) / n
    return 2.0 * (precision * recall) / (precision + recall + 1e-8)


def rouge_score(prediction: str, ground_truth: str, **_) -> float:
    try:
        return rouge_l_f(prediction, ground_truth)
    except ValueError:  # the official code catches every exception and scores 0
        return 0.0


def rouge_zh_score(prediction: str, ground_truth: str, **_) -> float:
    return rouge_score(" ".join(_cut(prediction)), " ".join(_cut(ground_truth)))


def classification_score(prediction: str, ground_truth: str, *, all_classes: Sequence[str], **_) -> float:
    matches = [c for c in all_classes if c in prediction]
    # The official loop removes items from the list it iterates, so the item after a removed one
    # is never examined; kept on purpose, since scores must match the published ones.
    for term in matches:
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _share_equal(numbers: list[str], target: str) -> float:
    return 0.0 if not numbers else sum(n == str(target) for n in numbers) / len(numbers)


def count_score(prediction: str, ground_truth: str, **_) -> float:
    return _share_equal(re.findall(r"\d+", prediction), ground_truth)


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
    return _share_equal(re.findall(r"\d+", prediction), re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **_) -> float:
    return _share_equal(re.findall(r"\d+", prediction), re.findall(r"段落(\d+)", ground_truth)[0])


def fuzz_ratio(a: str, b: str) -> int:
    """`fuzzywuzzy.fuzz.ratio` on its difflib fallback."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim_score(prediction: str, ground_truth: str, **_) -> float:
    line = next((ln for ln in prediction.lstrip("\n").split("\n")
                 if "`" not in ln and "#" not in ln and "//" not in ln), "")
    return fuzz_ratio(line, ground_truth) / 100


def first_number_score(prediction: str, ground_truth: str, **_) -> float:
    """kvjax's suite only (passkey and the two key-value retrievals): 1 if the first integer of the prediction is the
    answer (the landmark / LongLoRA passkey rule). Not a LongBench metric."""
    m = re.search(r"\d+", prediction)
    return float(m is not None and m.group() == str(ground_truth).strip())


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1_score, "qa_f1_zh": qa_f1_zh_score, "rouge": rouge_score, "rouge_zh": rouge_zh_score,
    "classification": classification_score, "retrieval": retrieval_score, "retrieval_zh": retrieval_zh_score,
    "count": count_score, "code_sim": code_sim_score, "first_number": first_number_score,
}


def sample_score(dataset: str, metric: str, prediction: str, answers: Sequence[str],
                 all_classes: Sequence[str] | None) -> float:
    """One sample: the first-line cut where LongBench makes it, then the max over the answers."""
    if metric not in METRICS:
        raise InvalidInput(f"unknown metric {metric!r}; known: {sorted(METRICS)}")
    if dataset in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    fn = METRICS[metric]
    best = 0.0
    for gt in answers:
        best = max(best, fn(prediction, gt, all_classes=all_classes))
    return best


def score(scores: Sequence[float]) -> float:
    """A dataset's score: `round(100 * mean, 2)`."""
    if not scores:
        raise InvalidInput("no samples to score")
    return round(100 * sum(scores) / len(scores), 2)


def bucket(length: int) -> str:
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"


def score_e(scores: Sequence[float], lengths: Sequence[int]) -> dict[str, float]:
    """LongBench-E: the score per length bucket (of the samples' `length` field); empty buckets omitted."""
    out: dict[str, list[float]] = {"0-4k": [], "4-8k": [], "8k+": []}
    for s, n in zip(scores, lengths):
        out[bucket(n)].append(s)
    # eval.py's scorer_e rounds `100 * np.mean(...)` (pairwise summation), where scorer sums in order:
    # the two can differ in the last place that round(., 2) keeps (40.62 vs 40.63 seen)
    return {k: round(100 * float(np.mean(v)), 2) for k, v in out.items() if v}
