"""The one mask spec (`kvjax.masks`) against hand-written cases, the kernels' tile masks against the
reference's on the same metadata, and the reference module free of kernels."""

from __future__ import annotations

import ast
import pathlib

import jax.numpy as jnp
import numpy as np

from kvjax import masks, reference
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
    ref = np.asarray(reference._bias_and_mask(s, pos[None, None], pos[None, None], None, 6))[0, 0, 0] > masks.MASKED
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
