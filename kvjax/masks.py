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
* Attention-Gate's eq. 7: a key the gate evicted is hidden from later queries, never from its own;
* Gemma 2's soft-cap, `cap * tanh(s / cap)` on the scaled logits, before any bias.

`Mask` gathers what a call asks for beyond causality and padding into one value, which the reference,
the kernels and `kvjax.layer` take as one argument (`mask=`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["alibi", "anchors", "key_keep"],
                   meta_fields=["window", "softcap"])
@dataclasses.dataclass(frozen=True, eq=False)
class Mask:
    """What a query sees and the bias it adds, beyond causality by positions and padding (always applied).

    `window`: a query sees only its `window` latest positions (Mistral, Gemma's local layers); `softcap`:
    Gemma 2's logit cap; `alibi`: the query heads' ALiBi slopes `[h]`; `anchors`: AnLLM's eq. 4 over a prompt
    (`AnchorMask`); `key_keep`: Attention-Gate's flags `[b, kvh, s]` per KV head, the keys later queries may
    see (eq. 7), bool or the gate's float flags (differentiable). A pytree: `window` and `softcap` are static
    (they shape the computation), the arrays are leaves. Where a call cannot apply a part (eq. 4 in a decode
    step, say) it refuses it by name rather than dropping it.
    """

    window: int | None = None
    softcap: float | None = None
    alibi: Float[Array, "h"] | None = None
    anchors: AnchorMask | None = None
    key_keep: Bool[Array, "b kvh s"] | Float[Array, "b kvh s"] | None = None

    @property
    def plain(self) -> bool:
        """Causal attention and nothing else."""
        return all(getattr(self, f.name) is None for f in dataclasses.fields(self))

    def given(self) -> list[str]:
        """The names of the parts set."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def only(self, allowed: tuple[str, ...], where: str) -> Mask:
        """Itself, or an error naming the parts `where` does not apply."""
        extra = [n for n in self.given() if n not in allowed]
        if extra:
            raise ValueError(f"{where} cannot apply the mask's {extra}; it takes {list(allowed)}")
        return self

    def replace(self, **changes) -> Mask:
        return dataclasses.replace(self, **changes)

    def heads(self, query_heads) -> Mask:
        """The mask of a subset of the query heads (a head group's): its ALiBi slopes only."""
        return self if self.alibi is None else self.replace(alibi=self.alibi[query_heads])


CAUSAL = Mask()
