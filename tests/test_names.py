"""One meaning per public name: the renamed keywords, attributes, flags and module still work, each with
a DeprecationWarning naming the new spelling, and give exactly what the new spelling gives."""

from __future__ import annotations

import importlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import generate as gen_cli
from kvjax import attention
from kvjax.anllm_anchors import anchor_mask
from kvjax.policies.anllm import AnchorReduction
from kvjax.policies.mat import AnchorCache, grid_search_anchors, mat
from kvjax.policies.ring import LocalWindow
from kvjax.policies.scored import TOVA, PyramidKV, SnapKV


def test_renamed_policy_keywords_and_attributes():
    with pytest.warns(DeprecationWarning, match=r"AnchorCache: the keyword anchors= is deprecated; use anchor_slots="):
        old = AnchorCache(budget=16, anchors=4)
    assert old == AnchorCache(budget=16, anchor_slots=4) and old.recent == 12
    with pytest.warns(DeprecationWarning, match=r"AnchorCache.anchors is deprecated; use .anchor_slots"):
        assert old.anchors == 4
    with pytest.warns(DeprecationWarning, match="mat: the keyword anchors="):
        assert mat(16, anchors=4) == mat(16, 4)
    with pytest.warns(DeprecationWarning, match="AnchorReduction: the keyword anchors="):
        assert AnchorReduction(anchor_ids=(5,), anchors=8) == AnchorReduction(anchor_ids=(5,), anchor_slots=8)
    with pytest.raises(TypeError, match=r"both anchors= \(deprecated\) and anchor_slots="):
        AnchorCache(budget=16, anchors=4, anchor_slots=4)
    with pytest.warns(DeprecationWarning, match="grid_search_anchors: the keyword anchors= is deprecated; use grid="):
        best, table = grid_search_anchors(16, lambda p: abs(p.deep.anchor_slots - 3), anchors=[1, 3, 5])
    assert best == 3 and table == {1: 2.0, 3: 0.0, 5: 2.0}


def test_anchor_mask_keyword_of_attention():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(1, 2, 8, 4), (1, 1, 8, 4), (1, 1, 8, 4)])
    pos = jnp.arange(8)[None]
    mask = anchor_mask(jnp.asarray([[False, False, True, False, False, True, False, False]]))
    new, _ = attention.prefill_attention(q, k, v, pos, pos, scale=0.5, anchor_mask=mask)
    with pytest.warns(DeprecationWarning, match="prefill_attention: the keyword anchors= is deprecated"):
        old, _ = attention.prefill_attention(q, k, v, pos, pos, scale=0.5, anchors=mask)
    plain, _ = attention.prefill_attention(q, k, v, pos, pos, scale=0.5)
    np.testing.assert_array_equal(np.asarray(old), np.asarray(new))
    assert not np.allclose(np.asarray(new), np.asarray(plain))  # the mask is applied, not dropped


def test_renamed_module_and_flag(tiny_dir, capsys):
    sys.modules.pop("kvjax.anchors", None)
    with pytest.warns(DeprecationWarning, match="kvjax.anchors is deprecated; import kvjax.anllm_anchors"):
        old = importlib.import_module("kvjax.anchors")
    assert old.anchor_mask is anchor_mask
    # the old flag parses to the new option; an error about it names the flag as typed
    with pytest.raises(ValueError, match=r"^--anchors: no policy of streaming takes it"):
        gen_cli.main(["--model", str(tiny_dir), "--policy", "streaming", "--anchors", "4"])
    assert "warning: --anchors is deprecated; use --anchor-slots" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^--anchor-slots: no policy of streaming takes it"):
        gen_cli.main(["--model", str(tiny_dir), "--policy", "streaming", "--anchor-slots", "4"])


def test_each_policy_window_is_named_for_what_it_is():
    """SnapKV & co's kept-and-scoring tail is observation_window, LocalWindow's ring is size, MAT's c - beta is
    recent; window= on a policy still works, warning."""
    with pytest.warns(DeprecationWarning, match="SnapKV: the keyword window= is deprecated; use observation_window="):
        assert SnapKV(budget=16, window=4) == SnapKV(budget=16, observation_window=4)
    with pytest.warns(DeprecationWarning, match="PyramidKV: the keyword window="):
        assert PyramidKV(budget=16, window=4, num_layers=2).observation_window == 4
    with pytest.warns(DeprecationWarning, match="LocalWindow: the keyword window= is deprecated; use size="):
        assert LocalWindow(window=8) == LocalWindow(size=8)
    with pytest.warns(DeprecationWarning, match=r"SnapKV.window is deprecated; use .observation_window"):
        assert SnapKV(budget=64).window == 32
    assert TOVA(budget=8).observation_window == 1 and AnchorCache(budget=16, anchor_slots=4).recent == 12
    assert "observation_window=4" in SnapKV(budget=16, observation_window=4).describe()


def test_the_old_window_flag(tiny_dir, capsys):
    with pytest.raises(ValueError, match=r"^--window: no policy of streaming takes it"):
        gen_cli.main(["--model", str(tiny_dir), "--policy", "streaming", "--window", "4"])
    assert "warning: --window is deprecated; use --observation-window" in capsys.readouterr().err


def test_the_sliding_window_hook_is_on_sliding_window():
    """`with_window` meant the model's sliding window: now `on_sliding_window`. Calling the old name warns and
    gives the same policy; a subclass that still overrides only `with_window` is still obeyed (warning), and its
    `super().with_window` call does not loop."""
    from kvjax.policies.ring import FullCache, StreamingLLM

    assert FullCache().on_sliding_window(8) == LocalWindow(size=8)
    with pytest.warns(DeprecationWarning, match="Policy.with_window is deprecated; use on_sliding_window"):
        assert FullCache().with_window(8) == LocalWindow(size=8)
    with pytest.warns(DeprecationWarning, match="Policy.with_window is deprecated"):
        assert StreamingLLM(sinks=4, budget=16).with_window(8) == StreamingLLM(sinks=4, budget=16)

    class OldStyle(StreamingLLM):
        def with_window(self, window):
            return LocalWindow(size=window) if window < 100 else super().with_window(window)

    with pytest.warns(DeprecationWarning, match="OldStyle.with_window is deprecated; override on_sliding_window"):
        assert OldStyle(sinks=4, budget=16).on_sliding_window(8) == LocalWindow(size=8)
    with pytest.warns(DeprecationWarning):
        policy = OldStyle(sinks=4, budget=16)
        assert policy.on_sliding_window(200) is policy
