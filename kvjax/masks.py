"""Which keys a query sees, and the bias it adds: the one mask spec of kvjax's attention.

The jnp reference (`kvjax.reference`) and the Pallas kernels (`kvjax.pallas.tiles`) both build
their masks from the functions below, so a rule is written once. They are elementwise over
arrays that broadcast `[..., queries, 1]` against `[..., 1, keys]`: the reference passes whole
`[b, kvh, g, tq, tk]` blocks, a kernel one `[bq, 1] x [1, bk]` tile of int32 metadata.

* causality by positions: a key is visible when its position is >= 0 (not padding) and not
  after the query's; `window` keeps only the query's `window` latest positions (Mistral);
* ALiBi (Press et al. 2022): `slope * (k - q)` added to the logit;
* AnLLM's eq. 4 (`AnchorMask`): a token sees its own sequence, a non-anchor also the earlier
  sequences' anchors, and every token the kept span;
* Attention-Gate's eq. 7: a key the gate evicted is hidden from later queries, never from its own.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

# Finite, so a row with no visible key (a padding query) gives a uniform, finite softmax (and a
# fully masked kernel tile an exp of 0) instead of NaN; such rows are never read.
MASKED = -1e30


def causal(q_pos, k_pos, window: int | None = None):
    """Keys at or before the query (padding, position -1, hidden), within `window` positions if given."""
    visible = (k_pos >= 0) & (k_pos <= q_pos)
    if window is not None:
        visible &= k_pos > q_pos - window  # the key is one of the query's `window` latest tokens
    return visible


def alibi_bias(slope, q_pos, k_pos, dtype):
    """ALiBi's additive bias `slope * (k - q)` (<= 0 for every visible key)."""
    return slope * (k_pos - q_pos).astype(dtype)


def eq4(q_seg, q_anchor, k_seg, k_anchor, k_keep):
    """AnLLM's eq. 4 without the causal part: own sequence, or an earlier sequence's anchor seen by a
    non-anchor query, or a key of the kept span. Anchor flags and `k_keep` are bool."""
    return (q_seg == k_seg) | (k_anchor & ~q_anchor & (k_seg < q_seg)) | k_keep


def eq4_blocks(q_seg, q_anchor, q_real, k_seg, k_anchor, k_keep, k_real):
    """Eq. 4 between blocks of tokens, from per-block summaries: `[b, nq, nk]`, False only where no
    query of the query block can see any key of the key block (segment ranges apart, no earlier
    anchor a non-anchor query could see, no kept key). Conservative, never exact: a True block may
    still be masked token by token. Queries `[b, nq, bq]`, keys `[b, nk, bk]`; `*_real` marks the
    tokens that are not padding; anchor and keep flags are bool."""
    big = jnp.iinfo(jnp.int32).max
    lo = lambda x, real: jnp.min(jnp.where(real, x, big), -1)  # noqa: E731
    hi = lambda x, real: jnp.max(jnp.where(real, x, -1), -1)  # noqa: E731
    qs_lo, qs_hi = lo(q_seg, q_real)[:, :, None], hi(q_seg, q_real)[:, :, None]
    ks_lo, ks_hi = lo(k_seg, k_real)[:, None, :], hi(k_seg, k_real)[:, None, :]
    ka_lo = lo(k_seg, k_real & k_anchor)[:, None, :]  # the earliest anchor's segment
    q_plain = jnp.any(q_real & ~q_anchor, -1)[:, :, None]
    kept = jnp.any(k_real & k_keep, -1)[:, None, :]
    return ((ks_lo <= qs_hi) & (qs_lo <= ks_hi)) | (q_plain & (ka_lo < qs_hi)) | kept


def own_key(q_pos, k_pos):
    """The query's own token, which the gate's flags never hide (eq. 7)."""
    return k_pos == q_pos


def gate(k_keep, q_pos, k_pos):
    """Attention-Gate's keep flags as a mask: a key the gate kept, or the query's own."""
    return k_keep | own_key(q_pos, k_pos)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AnchorMask:
    """AnLLM's eq. 4 over a prompt, from per-token arrays `[b, t]` (queries and keys are the same tokens).

    `segment`: index of the sequence a token belongs to (anchors before it); `anchor`: the token is
    its sequence's anchor; `keep`: keys every later token sees whatever eq. 4 says (the paper's
    "keep source" mode). A non-anchor sees its own sequence and earlier anchors; an anchor sees
    only its own sequence.
    """

    segment: Int[Array, "b t"]
    anchor: Bool[Array, "b t"]
    keep: Bool[Array, "b t"]

    def visible(self, q_idx: slice | None = None) -> Bool[Array, "b tq tk"]:
        """Eq. 4 without the causal part, for the queries `q_idx` (all by default)."""
        qs = self.segment if q_idx is None else self.segment[:, q_idx]
        qa = self.anchor if q_idx is None else self.anchor[:, q_idx]
        return eq4(qs[:, :, None], qa[:, :, None], self.segment[:, None, :], self.anchor[:, None, :],
                   self.keep[:, None, :])
