"""One meaning per public name. The spellings renamed in earlier rounds (MAT's and AnLLM's `anchors=` for
`anchor_slots=`, a policy's `window=` for `observation_window=` / `size=`, the attention functions' `anchors=`
for `anchor_mask=`, the module `kvjax.anchors`, `Policy.with_window`, the flags `--anchors` / `--window`) were
removed at 0.1.0: each is now refused where it is written, and the names that replaced them work."""

from __future__ import annotations

import importlib

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.experiments import generate as gen_cli
from kvjax import attention
from kvjax.anllm_anchors import anchor_mask
from kvjax.masks import Mask
from kvjax.policies.anllm import AnchorReduction
from kvjax.policies.mat import AnchorCache, grid_search_anchors, mat
from kvjax.policies.ring import FullCache, LocalWindow, StreamingLLM
from kvjax.policies.scored import TOVA, PyramidKV, SnapKV


def test_the_old_policy_keywords_are_refused_and_the_new_ones_work():
    for make in (lambda: AnchorCache(budget=16, anchors=4), lambda: mat(16, anchors=4),
                 lambda: AnchorReduction(anchor_ids=(5,), anchors=8), lambda: SnapKV(budget=16, window=4),
                 lambda: PyramidKV(budget=16, window=4, num_layers=2), lambda: LocalWindow(window=8)):
        with pytest.raises(TypeError, match="unexpected keyword argument '(anchors|window)'"):
            make()
    assert AnchorCache(budget=16, anchor_slots=4).recent == 12
    assert AnchorReduction(anchor_ids=(5,), anchor_slots=8).anchor_slots == 8
    best, table = grid_search_anchors(16, lambda p: abs(p.deep.anchor_slots - 3), grid=[1, 3, 5])
    assert best == 3 and table == {1: 2.0, 3: 0.0, 5: 2.0}
    for policy, old in ((AnchorCache(budget=16, anchor_slots=4), "anchors"), (SnapKV(budget=64), "window"),
                        (LocalWindow(size=8), "window")):
        assert not hasattr(policy, old), (policy, old)
    assert TOVA(budget=8).observation_window == 1 and LocalWindow(size=8).size == 8
    assert "observation_window=4" in SnapKV(budget=16, observation_window=4).describe()


def test_the_eq4_mask_is_anchor_mask_only():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(1, 2, 8, 4), (1, 1, 8, 4), (1, 1, 8, 4)])
    pos = jnp.arange(8)[None]
    mask = anchor_mask(jnp.asarray([[False, False, True, False, False, True, False, False]]))
    new, _ = attention.prefill_attention(q, k, v, pos, pos, scale=0.5, mask=Mask(anchors=mask))
    plain, _ = attention.prefill_attention(q, k, v, pos, pos, scale=0.5)
    assert not np.allclose(np.asarray(new), np.asarray(plain))  # the mask is applied, not dropped
    for old in ("anchors", "anchor_mask"):  # eq. 4 travels in the one mask value only
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
            attention.prefill_attention(q, k, v, pos, pos, scale=0.5, **{old: mask})


def test_the_old_module_and_flags_are_gone(tiny_dir, capsys):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kvjax.anchors")
    for flag in ("--anchors", "--window"):
        with pytest.raises(SystemExit) as exc:
            gen_cli.main(["--model", str(tiny_dir), "--policy", "streaming", flag, "4"])
        assert exc.value.code == 2 and f"unrecognized arguments: {flag}\n" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^--anchor-slots: no policy of streaming takes it"):
        gen_cli.main(["--model", str(tiny_dir), "--policy", "streaming", "--anchor-slots", "4"])


def test_the_sliding_window_hook_is_on_sliding_window():
    """The model's sliding window reaches a policy through `on_sliding_window` only (`with_window` is gone)."""
    assert FullCache().on_sliding_window(8) == LocalWindow(size=8)
    assert StreamingLLM(sinks=4, budget=16).on_sliding_window(8) == StreamingLLM(sinks=4, budget=16)
    assert not hasattr(FullCache(), "with_window")
