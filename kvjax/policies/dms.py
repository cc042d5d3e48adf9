"""DMS with a threshold on a prompt compressor's key score: kvpress 0.5.5's `DMSPress(press=KnormPress(), threshold,
sliding_window_size, decoding)`, the rule without DMS's trained evictors (the paper's per-head decisions learned by
distillation, which kvpress does not ship either).

Each token is scored once, as it is written, by the scorer's score of its own key (KNorm: minus its norm; KeyDiff:
its similarity to the mean of the keys written with it), and evicted once it has left the sliding window when that
score is below `threshold` (`kvjax.policies.delayed`). kvpress scores the new keys alone, with no attention, so a
scorer that needs attention statistics is refused.
"""

from __future__ import annotations

import dataclasses

from kvjax.errors import InvalidInput
from kvjax.policies.delayed import DelayedEviction
from kvjax.policies.options import Option, given, register
from kvjax.policies.scored import KeyDiff, KNorm, ScoredPolicy


@dataclasses.dataclass(frozen=True, kw_only=True)
class DMS(DelayedEviction):
    """Evicts each token whose `scorer` score is below `threshold` once it is older than the `window` most recent
    tokens (the module docstring). The scorer's own budget is unused: the threshold decides."""

    scorer: ScoredPolicy

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.scorer, ScoredPolicy):
            raise InvalidInput(f"DMS: scorer={self.scorer!r} is not a prompt compressor's score (KNorm, KeyDiff)")
        if self.scorer.stats(0).prefill:  # any statistic: attention's, the layer's or the model's
            raise InvalidInput(f"DMS: scorer={self.scorer.describe()} needs statistics of the attention; DMSPress "
                               "scores each new key alone (KNorm, KeyDiff)")

    def token_scores(self, layer, k, v, ctx):
        if k.ndim == 3:  # one decode step: [b, kvh, d], scored as a prompt of one token
            return self.scorer.score(layer, k[:, :, None], v[:, :, None], ctx.pos[:, None], None)[..., 0]
        return self.scorer.score(layer, k, v, ctx.pos, None)


SCORERS = {"knorm": KNorm, "keydiff": KeyDiff}
DMS_SCORER = Option(help="DMS: the score each new key gets (DMSPress's press)", choices=tuple(SCORERS))


def _dms(budget, threshold=None, dms_scorer="knorm", dms_window=None, dms_decoding=None) -> DMS:
    if threshold is None:
        raise InvalidInput("DMS evicts the tokens scored below a threshold: give it (--threshold)")
    # ratio 0: the scorer's own size is unused (the threshold decides), and 0 says it removes nothing by itself
    return DMS(scorer=SCORERS[dms_scorer](ratio=0.0), threshold=threshold,
               **given(window=dms_window, decoding=None if dms_decoding is None else bool(dms_decoding)))


register("dms", build=_dms, classes=(DMS,), options={"dms_scorer": DMS_SCORER}, budget=False,
         paper="Łańcucki et al. 2025 (DMS; threshold rule, no trained evictors)", docs="policies/decoding.md#dms",
         chunked="refused", kvpress="`DMSPress(KnormPress)`", memory="**masked** (slots emptied, not freed)")

__all__ = ["DMS"]
