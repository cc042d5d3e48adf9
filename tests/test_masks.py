"""The one mask spec (`kvjax.masks`) against hand-written cases, the kernels' tile masks against the
reference's on the same metadata, and the reference module free of kernels."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention, masks, reference
from kvjax.pallas import prefill as pprefill
from kvjax.pallas import tiles
from tests.test_anllm import eq4_reference

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_causal_window_and_padding_by_hand():
    pos = jnp.asarray([-1, 0, 1, 2, 3])  # one left-padding token, then positions 0..3
    got = np.asarray(masks.causal(pos[:, None], pos[None, :], window=2))
    # row: the query; a query sees itself and the one token before it, never padding
    want = np.array([[0, 0, 0, 0, 0],
                     [0, 1, 0, 0, 0],
                     [0, 1, 1, 0, 0],
                     [0, 0, 1, 1, 0],
                     [0, 0, 0, 1, 1]], bool)
    np.testing.assert_array_equal(got, want)
    no_window = np.array([[0, 0, 0, 0, 0],
                          [0, 1, 0, 0, 0],
                          [0, 1, 1, 0, 0],
                          [0, 1, 1, 1, 0],
                          [0, 1, 1, 1, 1]], bool)
    np.testing.assert_array_equal(np.asarray(masks.causal(pos[:, None], pos[None, :])), no_window)


def test_gate_hides_evicted_keys_but_never_a_querys_own():
    pos = jnp.arange(4)
    keep = jnp.asarray([True, False, True, False])
    got = np.asarray(masks.gate(keep[None, :], pos[:, None], pos[None, :]) & masks.causal(pos[:, None], pos[None, :]))
    want = np.array([[1, 0, 0, 0],
                     [1, 1, 0, 0],   # key 1 evicted, but query 1 still sees itself
                     [1, 0, 1, 0],
                     [1, 0, 1, 1]], bool)
    np.testing.assert_array_equal(got, want)


def test_alibi_bias_is_slope_times_distance_back():
    q, k = jnp.asarray([[5]]), jnp.asarray([[2, 5]])
    np.testing.assert_allclose(np.asarray(masks.alibi_bias(0.25, q, k, jnp.float32)), [[-0.75, 0.0]])


def _meta(flags):
    """Per-token eq. 4 metadata as AnLLM builds it: sequence index (anchors close their sequence)."""
    seg = np.cumsum([0] + [int(a) for a in flags[:-1]])
    return jnp.asarray(seg), jnp.asarray(flags, bool)


def test_reference_and_kernel_tiles_draw_the_same_mask():
    """The reference masks `[b, kvh, g, tq, tk]` score blocks, a kernel `[bq, 1] x [1, bk]` tiles of int32
    metadata: on one prompt with anchors, a window, gate flags and padding, both equal the transcription."""
    flags = [0, 1, 0, 0, 1, 0, 0, 0, 1, 0]
    seg, anchor = _meta(flags)
    pos = jnp.arange(10)
    keep = jnp.zeros(10, bool)
    gate = jnp.asarray([1, 1, 0, 1, 1, 0, 1, 1, 1, 1], bool)
    hand = eq4_reference(flags) & (np.arange(10)[None, :] > np.arange(10)[:, None] - 6)  # window 6
    hand &= np.asarray(gate)[None, :] | np.eye(10, dtype=bool)

    q_meta = tiles.QueryMeta(pos[:, None], seg[:, None], anchor.astype(jnp.int32)[:, None])
    k_meta = tiles.KeyMeta(pos[None, :], seg[None, :], anchor.astype(jnp.int32)[None, :], keep.astype(jnp.int32)[None])
    kernel = np.asarray(tiles.tile_visible(q_meta, k_meta, gate.astype(jnp.int32)[None, :], window=6))
    np.testing.assert_array_equal(kernel, hand)

    s = jnp.zeros((1, 1, 1, 10, 10))
    ref = np.asarray(reference._bias_and_mask(s, pos[None, None], pos[None, None], masks.Mask(window=6)))[0, 0, 0] > masks.MASKED
    ref &= np.asarray(masks.AnchorMask(seg[None], anchor[None], keep[None]).visible())[0]
    ref &= np.asarray(masks.gate(gate[None, :], pos[:, None], pos[None, :]))
    np.testing.assert_array_equal(ref, hand)


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_the_reference_and_the_mask_spec_import_no_kernel_and_no_dispatch():
    for module in ("kvjax/reference.py", "kvjax/masks.py"):
        bad = {n for n in _imports(ROOT / module) if n.startswith(("kvjax.pallas", "kvjax.attention"))}
        assert not bad, f"{module} imports {sorted(bad)}"
    # dispatch lives in one place: only kvjax.attention reaches for the kernels' entry points
    callers = [p.relative_to(ROOT).as_posix() for p in (ROOT / "kvjax").rglob("*.py")
               if "kvjax/pallas" not in p.as_posix() and any(n.startswith("kvjax.pallas") or n == "kvjax.pallas"
                                                             for n in _imports(p))]
    assert callers == ["kvjax/attention.py"], callers


# --- the one mask value (`kvjax.masks.Mask`) ---------------------------------------------------------------


def test_one_mask_value_by_hand_window_and_alibi():
    """`Mask(window=2, alibi=...)` through the reference's logits: hand-computed scores for one query head
    (q.k = 1 for every key, scale 1) at position 3, keys 0..3: ALiBi's slope * (k - q), keys older than the
    window hidden."""
    q = jnp.ones((1, 1, 1, 1))
    k = jnp.ones((1, 1, 4, 1))
    pos = jnp.arange(4)[None]
    got = np.asarray(reference.logits(q, k, pos[:, 3:], pos, scale=1.0, mask=masks.Mask(window=2, alibi=np.asarray(
        [0.5], np.float32))))[0, 0, 0, 0]
    hand = [masks.MASKED, masks.MASKED, 1 - 0.5, 1.0]  # keys 0, 1 outside the window of 2; key 2 one back
    np.testing.assert_allclose(got, hand)


def test_a_mask_is_one_pytree_argument_compiled_once_per_window():
    """The flags and slopes are leaves (new values: no recompile); the window and soft-cap are static (a new
    window compiles once more)."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(1, 2, 6, 4), (1, 1, 6, 4), (1, 1, 6, 4)])
    pos = jnp.arange(6)[None]
    traces = []

    @jax.jit
    def run(mask):
        traces.append(mask.window)
        return attention.prefill_attention(q, k, v, pos, pos, scale=0.5, mask=mask)[0]

    for seed in range(3):
        flags = jnp.asarray(np.random.default_rng(seed).random((1, 1, 6)) < 0.5)
        run(masks.Mask(window=3, key_keep=flags, alibi=jnp.asarray([0.1, 0.2])))
    assert traces == [3]
    run(masks.Mask(window=4, key_keep=flags, alibi=jnp.asarray([0.1, 0.2])))
    assert traces == [3, 4]


def test_a_part_a_call_cannot_apply_is_refused_by_name():
    """Eq. 4 and gate flags belong to a prompt: a decode step refuses them, a chunk over a cache refuses gate
    flags, the Pallas prefill refuses soft-capping; nothing is dropped silently."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, 2, 4)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 5, 4)), jnp.float32)
    slot_pos = jnp.arange(5, dtype=jnp.int32)[None, None]
    flags = jnp.ones((1, 1, 5), bool)
    with pytest.raises(ValueError, match=r"decode_attention cannot apply the mask's \['key_keep'\]"):
        attention.decode_attention(q, k, k, slot_pos, jnp.zeros((1, 1, 5)), scale=0.5, mask=masks.Mask(key_keep=flags))
    chunk = jnp.asarray(rng.normal(size=(1, 2, 3, 4)), jnp.float32)
    kc = jnp.asarray(rng.normal(size=(1, 1, 3, 4)), jnp.float32)
    with pytest.raises(ValueError, match=r"prefix_attention cannot apply the mask's \['key_keep'\]"):
        attention.prefix_attention(chunk, kc, kc, jnp.arange(5, 8)[None], k, k, slot_pos, jnp.zeros((1, 1, 5)),
                                   scale=0.5, mask=masks.Mask(key_keep=flags))
    with pytest.raises(ValueError, match=r"pallas prefill_attention cannot apply the mask's \['softcap'\]"):
        pprefill.prefill_attention(chunk, kc, kc, jnp.arange(3)[None], jnp.arange(3)[None], scale=0.5,
                                   mask=masks.Mask(softcap=30.0), variant="gpu", interpret=True)


def test_a_head_groups_mask_keeps_its_query_heads_slopes():
    """RazorAttention's head groups attend with their own query heads' ALiBi slopes: `Mask.heads`."""
    slopes = reference.alibi_slopes(6)
    np.testing.assert_array_equal(masks.Mask(alibi=slopes, window=9).heads([1, 4]).alibi, slopes[[1, 4]])
    assert masks.Mask(alibi=slopes, window=9).heads([1, 4]).window == 9
