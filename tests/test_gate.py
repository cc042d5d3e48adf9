"""Attention-Gate: eq. 7 mask, the straight-through estimator, prefill eviction + decode, saving, errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax import attention
from kvjax import cache as kvcache
from kvjax.gate import (PRESETS, GateConfig, attach_gates, eviction_loss, load_gates, save_gates, ste_flags,
                        without_gates)
from kvjax.generate import generate
from kvjax.masks import Mask
from kvjax.policies import FullCache, GateEviction, make_policy
from kvjax.models import load
from kvjax import drive
from tests.conftest import prefill_policy


def _eq7_reference(q, k, v, pos, flags):
    """Eq. 7 by loops: query s sees key t iff t <= s and (t == s or flag[t]); padding rows are zero."""
    b, h, t, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    out = np.zeros((b, h, t, d))
    for r in range(b):
        for hh in range(h):
            kh = hh // g
            for s in range(t):
                if pos[r, s] < 0:
                    continue
                seen = [j for j in range(t) if 0 <= pos[r, j] <= pos[r, s] and (j == s or flags[r, kh, j])]
                logit = np.array([q[r, hh, s] @ k[r, kh, j] for j in seen]) / np.sqrt(d)
                p = np.exp(logit - logit.max())
                out[r, hh, s] = (p / p.sum()) @ v[r, kh, seen]
    return out


def test_forward_mask_is_eq7():
    rng = np.random.default_rng(0)
    b, h, kvh, t, d = 2, 4, 2, 13, 8
    q, k, v = (rng.normal(size=s) for s in [(b, h, t, d), (b, kvh, t, d), (b, kvh, t, d)])
    pos = np.stack([np.arange(t), np.arange(t) - 4]).clip(-1)  # the second row left-padded
    flags = rng.random((b, kvh, t)) < 0.4
    want = _eq7_reference(q, k, v, pos, flags)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)] + [jnp.asarray(pos, jnp.int32)] * 2
    real = (pos >= 0)[:, None, :, None]
    for keep in (jnp.asarray(flags), jnp.asarray(flags, jnp.float32)):  # bool mask and the STE's float flags
        out, _ = attention.prefill_attention(*args, scale=d**-0.5, mask=Mask(key_keep=keep))
        np.testing.assert_allclose(np.where(real, out, 0), want, atol=1e-5)


def test_gradient_reaches_evicted_flags():
    """The product form gives evicted keys' flags a gradient (the -inf mask would give none)."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 2, 9, 8)), jnp.float32) for _ in range(3))
    pos = jnp.arange(9, dtype=jnp.int32)[None]
    flags = jnp.asarray(rng.random((1, 2, 9)) < 0.5, jnp.float32)
    grad = jax.grad(lambda f: jnp.sum(attention.prefill_attention(q, k, v, pos, pos, scale=0.3, mask=Mask(key_keep=f))[0] ** 2))
    g = np.asarray(grad(flags))
    assert np.all(np.abs(g[..., :-1]) > 0)  # every key but the last has later queries, evicted or not


def test_ste_forward_is_binary_and_backward_is_the_sigmoid():
    x = jnp.linspace(-6, 6, 101)
    c = jnp.cos(jnp.arange(101.0))
    for gamma, tau in [(2.0, 0.5), (0.0, 0.3)]:
        f = ste_flags(x, gamma, tau)
        assert set(np.unique(np.asarray(f)).tolist()) == {0.0, 1.0}
        np.testing.assert_array_equal(f, (jax.nn.sigmoid(x + gamma) > tau).astype(jnp.float32))
        g_ste = jax.grad(lambda x: jnp.sum(ste_flags(x, gamma, tau) * c))(x)
        g_sig = jax.grad(lambda x: jnp.sum(jax.nn.sigmoid(x + gamma) * c))(x)
        np.testing.assert_allclose(g_ste, g_sig, rtol=1e-6)


def test_eviction_loss():
    flags = [jnp.asarray([[[1.0, 0.0, 1.0, 1.0]]]), jnp.asarray([[[0.0, 0.0, 1.0, 0.0]]])]
    real = jnp.asarray([[0.0, 1.0, 1.0, 1.0]])  # the first token is padding
    loss, kept = eviction_loss(flags, real, GateConfig(alpha=5.0, beta=0.4))
    assert float(kept) == pytest.approx(3 / 6) and float(loss) == pytest.approx(5 * 0.1)


def _gated(tiny_dir, cfg=GateConfig(gamma=0.0, tau=0.5), seed=3):
    """A fresh tiny model with random gates that evict about half the tokens."""
    model = load(tiny_dir).model
    attach_gates(model, cfg, seed=seed)
    for layer in model.layers:  # larger random output weights: decisive, varied flags
        o = layer.self_attn.gate.o_proj.kernel
        o.set_value(o[...] * 20)
    return model


def _eq7_forward(model, tokens, pos, n_prompt, gated=None):
    """Full forward in which prompt tokens follow their gate flags and later tokens are all kept;
    layers not in `gated` (default: all are) attend causally, their gates unused."""
    x = model.embed_tokens(tokens)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = attn.qkv(h)
        p = pos[:, None, :]
        flags = attn.gate(h, pos) if gated is None or i in gated else jnp.ones(k.shape[:3])
        keep = jnp.where((pos >= n_prompt)[:, None, :], 1.0, flags)
        o, _ = attention.prefill_attention(attn._rotate(q, p), attn._rotate(k, p), v, pos, pos,
                                           scale=attn.cfg.head_dim**-0.5, mask=Mask(key_keep=keep))
        x = layer._finish(x, attn._out(o))
    return model._logits(x)


def test_prefill_evict_then_decode_equals_the_eq7_forward(tiny_dir):
    model = _gated(tiny_dir)
    rng = np.random.default_rng(0)
    bucket, n_new = 24, 6
    lengths = [24, 15]  # the second prompt left-padded
    seqs = [rng.integers(4, model.cfg.vocab_size, n + n_new) for n in lengths]
    toks = np.zeros((2, bucket), np.int32)
    pos = np.full((2, bucket), -1, np.int32)
    for r, (s, n) in enumerate(zip(seqs, lengths)):
        toks[r, bucket - n:], pos[r, bucket - n:] = s[:n], np.arange(n)
    policy = GateEviction(bucket=8)
    logits, cache = prefill_policy(model, jnp.asarray(toks), jnp.asarray(pos), policy, bucket + n_new)
    small_policy, cache = policy.shrink(cache, n_new)
    # Kept slots: exactly the real prompt tokens whose flag is 1, per KV head, in time order.
    _, flags = drive.forward(model, jnp.asarray(toks), jnp.asarray(pos))
    for layer, (c, f) in enumerate(zip(cache, flags)):
        for r in range(2):
            for h in range(model.cfg.num_kv_heads):
                want = [int(pos[r, j]) for j in range(bucket) if pos[r, j] >= 0 and f[r, h, j] > 0]
                got = np.asarray(c.pos[r, h])
                assert got[got >= 0].tolist() == want
        assert c.capacity == small_policy.kept[layer] + n_new < bucket + n_new
    evicted = 1 - np.mean([float(jnp.mean(f[1][:, -15:])) for f in flags])
    assert 0.2 < evicted < 0.8, evicted  # the test really evicts
    got = [np.asarray(logits)]
    for i in range(n_new - 1):
        tok = jnp.asarray([s[n + i] for s, n in zip(seqs, lengths)], jnp.int32)
        step_logits, cache = drive.decode(model, tok, jnp.asarray(lengths, jnp.int32) + i, cache, drive.plan(model, small_policy))
        got.append(np.asarray(step_logits))
    for r, (s, n) in enumerate(zip(seqs, lengths)):
        full_pos = jnp.arange(n + n_new - 1, dtype=jnp.int32)[None]
        ref = _eq7_forward(model, jnp.asarray(s[None, : n + n_new - 1]), full_pos, n)
        want = np.asarray(ref[0, n - 1 :])
        np.testing.assert_allclose(np.stack([g[r] for g in got]), want, atol=1e-5, rtol=0)


def test_generate_with_the_gate_shrinks_the_cache(tiny_dir):
    model = _gated(tiny_dir)
    prompts = [list(np.random.default_rng(2).integers(4, model.cfg.vocab_size, 40))]
    full = generate(model, prompts, FullCache(), max_new_tokens=5)
    gated = generate(model, prompts, make_policy("gate", bucket=8), max_new_tokens=5)
    assert kvcache.nbytes(gated.cache) < 0.8 * kvcache.nbytes(full.cache)
    room = gated.room  # the 5 new tokens' buffer (a bucket of 16)
    assert all((c.capacity - room) % 8 == 0 or c.capacity - room == gated.prompt_bucket for c in gated.cache)


def test_save_load_roundtrip_and_errors(tiny_dir, sharp_mha_dir, tmp_path):
    model = _gated(tiny_dir)
    save_gates(model, tmp_path / "g")
    other = load_gates(load(tiny_dir).model, tmp_path / "g")
    toks = jnp.asarray([[5, 6, 7, 8, 9]])
    _, a = drive.forward(model, toks)
    _, b = drive.forward(other, toks)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="trained for a model with"):
        load_gates(load(sharp_mha_dir).model, tmp_path / "g")
    with pytest.raises(FileNotFoundError, match="gate.json"):
        load_gates(load(tiny_dir).model, tmp_path / "missing")
    with pytest.raises(ValueError, match="tau=1.5"):
        load_gates(load(tiny_dir).model, tmp_path / "g", tau=1.5)
    with pytest.raises(ValueError, match="needs Attention-Gates"):
        generate(load(tiny_dir).model, [[5, 6, 7]], GateEviction(), max_new_tokens=2)
    with pytest.raises(ValueError, match="no Attention-Gates to save"):
        save_gates(load(tiny_dir).model, tmp_path / "h")


@pytest.mark.parametrize("kw, bad", [(dict(tau=0.0), "tau=0.0"), (dict(tau=1.0), "tau=1.0"),
                                     (dict(beta=0.6), "beta=0.6"), (dict(beta=-0.1), "beta=-0.1"),
                                     (dict(gamma=-1.0), "gamma=-1.0"), (dict(heads=0), "heads=0")])
def test_config_errors(kw, bad):
    with pytest.raises(ValueError, match=bad):
        GateConfig(**kw)


def test_presets_are_the_papers():
    assert (PRESETS["cpt"].tau, PRESETS["cpt"].gamma, PRESETS["cpt"].alpha, PRESETS["cpt"].beta) == (0.5, 2, 5, 0.4)
    assert (PRESETS["sft"].tau, PRESETS["sft"].gamma, PRESETS["sft"].beta) == (0.3, 0, 0.28)


def test_gates_are_off_for_other_policies(tiny_dir):
    """A gated model under FullCache behaves as the base model (the gates run only for GateEviction)."""
    base = load(tiny_dir).model
    gated = _gated(tiny_dir)
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33]]
    a = generate(base, prompts, FullCache(), max_new_tokens=4)
    b = generate(gated, prompts, FullCache(), max_new_tokens=4)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert nnx.state(gated, nnx.Param)["layers"][0]["self_attn"]["gate"]  # the gates are there


def test_lora_starts_at_the_base_model_and_merges_exactly(tiny_dir):
    from kvjax.lora import LoRALinear, attach_lora, merge_lora

    model = load(tiny_dir).model
    toks = jnp.asarray([[5, 6, 7, 8, 9, 10]])
    base = np.asarray(drive.logits(model, toks))
    attach_lora(model, rank=4, alpha=8.0)
    np.testing.assert_allclose(drive.logits(model, toks), base, atol=1e-6)  # B = 0: unchanged at step 0
    rng = np.random.default_rng(0)
    for layer in model.layers:
        for name in ("q_proj", "v_proj", "o_proj"):
            b = getattr(layer.self_attn, name).lora_b
            b.set_value(jnp.asarray(rng.normal(size=b[...].shape) * 0.05, jnp.float32))
    adapted = np.asarray(drive.logits(model, toks))
    assert np.abs(adapted - base).max() > 1e-3
    merge_lora(model)
    assert not any(isinstance(getattr(layer.self_attn, n), LoRALinear) for layer in model.layers
                   for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    np.testing.assert_allclose(drive.logits(model, toks), adapted, atol=1e-5)
    with pytest.raises(ValueError, match="rank=0"):
        attach_lora(model, rank=0)


def test_train_gate_cli_cpt_then_generate(tiny_dir, tmp_path, capsys):
    """CPT trains only the gates (base weights unchanged), lowers the kept share towards beta, writes
    the gates, the eviction table / plot and the baseline comparison; generate runs on them."""
    from kvjax.experiments import generate as gen_cli
    from kvjax.experiments import train_gate

    out = tmp_path / "gates"
    argv = ["--model", str(tiny_dir), "--mode", "cpt", "--out", str(out), "--steps", "12", "--seq-len", "64",
            "--eval-windows", "4", "--save-every", "6", "--lr", "1e-2"]
    assert train_gate.main(argv) == 0
    history = json.loads((out / "training" / "loss.json").read_text())
    assert history[-1]["kept"] < history[0]["kept"] - 0.2
    r = json.loads((out / "eval" / "results.json").read_text())
    layers, kvh = load(tiny_dir).config.num_layers, load(tiny_dir).config.num_kv_heads
    assert np.asarray(r["eviction"]["per_layer_head"]).shape == (layers, kvh)
    assert set(r["continuation_nll"]) == {"full", "gate", "local", "streaming", "h2o"}
    assert (out / "eval" / "eviction.png").stat().st_size > 0 and (out / "eval" / "results.md").is_file()
    # Only the gates were trained: the gated model's base weights are the checkpoint's.
    trained = load_gates(load(tiny_dir).model, out)
    np.testing.assert_array_equal(trained.layers[0].self_attn.q_proj.kernel[...],
                                  load(tiny_dir).model.layers[0].self_attn.q_proj.kernel[...])
    capsys.readouterr()
    assert gen_cli.main(["--model", str(tiny_dir), "--policy", "gate", "--gate-params", str(out), "--bucket", "8",
                         "--max-new-tokens", "3", "hello world, hello"]) == 0
    assert "GateEviction" in capsys.readouterr().out
    from kvjax.errors import InvalidInput

    with pytest.raises(InvalidInput, match="needs --gate-params"):
        gen_cli.main(["--model", str(tiny_dir), "--policy", "gate", "hi"])


def test_train_gate_cli_sft_merges_lora(tiny_dir, tmp_path):
    from kvjax.experiments import train_gate

    out = tmp_path / "sft"
    assert train_gate.main(["--model", str(tiny_dir), "--mode", "sft", "--out", str(out), "--steps", "3",
                            "--seq-len", "256", "--sft-items", "8"]) == 0
    merged = load(out / "model").model
    assert not np.array_equal(merged.layers[0].self_attn.q_proj.kernel[...],
                              load(tiny_dir).model.layers[0].self_attn.q_proj.kernel[...])
    cfg = json.loads((out / "gate.json").read_text())["config"]
    assert (cfg["tau"], cfg["gamma"], cfg["beta"]) == (0.3, 0.0, 0.28)
    load_gates(merged, out)  # the gates fit the merged model


def test_gate_inside_by_layer_gates_its_layers_only(tiny_dir):
    """Seen before: ByLayer did not forward `uses_gate` or `shrink`, so a gate policy inside it never ran
    its gates (nothing evicted, no error). Now the gate layer keeps exactly its flagged prompt tokens,
    the other layer keeps everything and attends causally, and the logits are the eq. 7 forward's with
    the gate in layer 0 only."""
    from kvjax.policies import by_layer

    model = _gated(tiny_dir)
    rng = np.random.default_rng(5)
    n, n_new = 24, 5
    seq = rng.integers(4, model.cfg.vocab_size, n + n_new)
    toks, pos = jnp.asarray(seq[None, :n], jnp.int32), jnp.arange(n, dtype=jnp.int32)[None]
    policy = by_layer(GateEviction(bucket=8), FullCache(), split=1)
    logits, cache = prefill_policy(model, toks, pos, policy, n + n_new)
    small, cache = policy.shrink(cache, n_new)
    _, flags = drive.forward(model, toks, pos)
    for h in range(model.cfg.num_kv_heads):
        got = np.asarray(cache[0].pos[0, h])
        assert got[got >= 0].tolist() == [j for j in range(n) if flags[0][0, h, j] > 0]
        assert np.asarray(cache[1].pos[0, h])[:n].tolist() == list(range(n))  # FullCache: every token
    assert cache[0].capacity < n + n_new == cache[1].capacity  # only the gate layer shrank
    got = [np.asarray(logits[0])]
    for i in range(n_new - 1):
        step, cache = drive.decode(model, jnp.asarray([seq[n + i]], jnp.int32), jnp.asarray([n + i], jnp.int32), cache, drive.plan(model, small))
        got.append(np.asarray(step[0]))
    ref = _eq7_forward(model, jnp.asarray(seq[None, : n + n_new - 1]), jnp.arange(n + n_new - 1)[None], n, gated={0})
    np.testing.assert_allclose(np.stack(got), np.asarray(ref[0, n - 1:]), atol=1e-5, rtol=0)
    everywhere = _eq7_forward(model, jnp.asarray(seq[None, :n]), pos, n)
    assert np.abs(np.asarray(everywhere[0, -1]) - got[0]).max() > 1e-3  # layer 1's gate would change them


def test_gate_prompts_with_different_kept_counts_in_one_bucket_share_a_compiled_decode(tiny_dir):
    """Capacities are bucketed globally (one size for every layer), so two prompts whose layers keep
    different counts, all within one bucket, decode with one compiled program."""
    from tests.conftest import compile_log

    model = _gated(tiny_dir)
    rng = np.random.default_rng(7)
    prompts = [list(rng.integers(4, model.cfg.vocab_size, 40)) for _ in range(2)]
    policy = make_policy("gate", bucket=64)
    first = generate(model, [prompts[0]], policy, max_new_tokens=4)
    with compile_log() as log:
        second = generate(model, [prompts[1]], policy, max_new_tokens=4)
    kept = [[int(np.max(np.sum(np.asarray(c.pos) >= 0, -1))) for c in g.cache] for g in (first, second)]
    assert kept[0] != kept[1]  # the prompts' layers keep different counts
    assert log == []


def test_learning_rate_defaults_follow_the_mode(tiny_dir, tmp_path, monkeypatch):
    """SFT defaults to the paper's 5e-5 (sec. 4.2); CPT, which trains only the new gates, to 1e-3."""
    from kvjax.experiments import train_gate

    seen = {}

    class Stop(Exception):
        pass

    def fake_train(model, batch, loss, cfg, out, **kw):
        seen["lr"] = cfg.lr
        raise Stop

    monkeypatch.setattr(train_gate, "train", fake_train)
    for mode, lr in (("sft", 5e-5), ("cpt", 1e-3)):
        with pytest.raises(Stop):
            train_gate.main(["--model", str(tiny_dir), "--mode", mode, "--out", str(tmp_path / mode), "--steps", "1",
                             "--sft-items", "8", "--eval-windows", "2"])
        assert seen["lr"] == lr


def test_eval_gate_baselines_at_matched_or_fixed_eviction(tiny_dir):
    """Table 1's protocol (baselines at a fixed 50 %) or matched eviction (the gates' measured share of
    the prefix), with the eviction reported either way; the full cache's NLL is the same in both."""
    from kvjax.experiments.eval_gate import evaluate

    model = _gated(tiny_dir)
    tokens = np.random.default_rng(4).integers(4, model.cfg.vocab_size, (4, 32)).astype(np.int32)
    matched = evaluate(model, tokens, prefix_share=0.75, batch=4)
    fixed = evaluate(model, tokens, prefix_share=0.75, batch=4, baseline_eviction=0.5)
    p = matched["prefix"]
    assert matched["baseline_eviction_source"] == "gates" and fixed["baseline_eviction_source"] == "fixed"
    # measured in the caches the continuations read: the baselines hold the evicted share's complement of the
    # prefix (one token of rounding), at the gates' own share when matched
    for name in ("local", "streaming", "h2o"):
        assert abs(fixed["kept_prefix"][name] - 0.5) <= 1 / p, (name, fixed["kept_prefix"])
        assert abs(matched["kept_prefix"][name] - (1 - matched["eviction"]["prefix"])) <= 1 / p + 1e-6
    assert fixed["kept_prefix"]["full"] == 1.0 and fixed["baseline_eviction"] == 0.5
    assert fixed["continuation_nll"]["full"] == pytest.approx(matched["continuation_nll"]["full"])
    assert 0 < matched["eviction"]["prefix"] < 1
    # each window's NLL is its own: the full cache's equals the uncached forward's loss on the continuation
    with without_gates(model):
        logits, _ = drive.forward(model, jnp.asarray(tokens))
    lp = jax.nn.log_softmax(np.asarray(logits, np.float64)[:, p - 1 : -1], axis=-1)
    ref = -np.take_along_axis(np.asarray(lp), tokens[:, p:, None], axis=-1)[..., 0].mean(axis=1)
    np.testing.assert_allclose(matched["nll_windows"]["full"], ref, rtol=1e-4)
    assert matched["delta_se"]["full"] == 0.0 and matched["delta_se"]["h2o"] > 0
    gap = matched["continuation_nll"]["gate"] - matched["continuation_nll"]["h2o"]
    assert matched["gate_minus_baseline"]["h2o"]["diff"] == pytest.approx(gap)
    assert set(matched["gate_minus_baseline"]) == {"local", "streaming", "h2o"}


def test_paired_standard_error_by_hand():
    """s.e. of the per-window difference from the full cache: d = (0.5, 0, 0.4), mean 0.3, sample s.d.
    sqrt(0.14 / 2), so s.e. sqrt(0.07 / 3); None where windows are missing (records of an older run)."""
    from kvjax.experiments.eval_gate import paired_se

    se = paired_se({"full": [1.0, 2.0, 3.0], "x": [1.5, 2.0, 3.4], "old": None})
    assert se["x"] == pytest.approx(np.sqrt(0.07 / 3)) and se["full"] == 0.0 and se["old"] is None
    # against another reference: x - y = (0.5, -1, 0.4), mean -0.0333, s.d. sqrt(1.4467 / 2)
    se = paired_se({"x": [1.5, 2.0, 3.4], "y": [1.0, 3.0, 3.0]}, ref="y")
    assert se["x"] == pytest.approx(np.sqrt((0.5333 ** 2 + 0.9667 ** 2 + 0.4333 ** 2) / 2 / 3), rel=1e-3)


def _rotate_half(x, pos, theta):
    """HF Llama's RoPE on one vector of even length d at position `pos` (pairs i, i + d/2)."""
    d = x.shape[-1]
    ang = pos * theta ** (-np.arange(0, d, 2) / d)
    a, b = x[: d // 2], x[d // 2:]
    return np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)])


def _gate_reference(x, wq, wk, wv, wo, heads, gamma, tau, theta=None):
    """Sec. 3.3 transcribed with loops: MHA' (h' heads, causal softmax over the sequence; with `theta`,
    queries and keys rotated by the model's RoPE at their positions, as a gate of a RoPE model sees
    them), its heads concatenated through W^O' to one logit per (KV) head, then
    sigmoid(logit + gamma) > tau."""
    t, _ = x.shape
    dk = wq.shape[1] // heads
    rot = (lambda y, i: y) if theta is None else (lambda y, i: _rotate_half(y, i, theta))  # noqa: E731
    logits = np.zeros((t, wo.shape[1]))
    for i in range(t):
        outs = []
        for h in range(heads):
            cols = slice(h * dk, (h + 1) * dk)
            q = rot(x[i] @ wq[:, cols], i)
            s = np.array([q @ rot(x[j] @ wk[:, cols], j) / np.sqrt(dk) for j in range(i + 1)])
            p = np.exp(s - s.max())
            p /= p.sum()
            outs.append(sum(p[j] * (x[j] @ wv[:, cols]) for j in range(i + 1)))
        logits[i] = np.concatenate(outs) @ wo
    return logits.T, (1 / (1 + np.exp(-(logits.T + gamma))) > tau)


@pytest.mark.parametrize("theta", [None, 10000.0])
def test_gate_module_is_the_papers_mha_prime_and_gate(theta):
    """The gate against a transcription of sec. 3.3: its logits and flags `[kv_heads, t]` (one output per
    KV head of the attention it gates: kvjax's reading for GQA), and causality (a later token never
    changes an earlier flag); with the RoPE every RoPE model's gate uses (`attach_gates` passes the
    model's), and without (ALiBi)."""
    from kvjax.gate import AttentionGate
    from kvjax.rope import RopeConfig

    cfg = GateConfig(tau=0.5, gamma=0.3, heads=2, head_dim=8)
    rope = None if theta is None else RopeConfig(theta=theta)
    gate = AttentionGate(hidden=24, kv_heads=3, head_dim=16, cfg=cfg, rope=rope, rngs=nnx.Rngs(1))
    x = np.random.default_rng(3).normal(size=(1, 11, 24)).astype(np.float32)
    pos = jnp.arange(11, dtype=jnp.int32)[None]
    w = {n: np.asarray(getattr(gate, n).kernel[...], np.float64) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    want_logits, want_flags = _gate_reference(x[0].astype(np.float64), w["q_proj"], w["k_proj"], w["v_proj"],
                                              w["o_proj"], cfg.heads, cfg.gamma, cfg.tau, theta)
    np.testing.assert_allclose(np.asarray(gate.logits(jnp.asarray(x), pos))[0], want_logits, atol=1e-5)
    flags = np.asarray(gate(jnp.asarray(x), pos))[0]
    assert flags.shape == (3, 11) and set(np.unique(flags)) <= {0.0, 1.0}
    np.testing.assert_array_equal(flags.astype(bool), want_flags)
    later = x.copy()
    later[0, 7:] += 5.0
    np.testing.assert_array_equal(np.asarray(gate(jnp.asarray(later), pos))[0, :, :7], flags[:, :7])


def test_table_1_protocol_accuracy_and_eviction_through_the_zero_shot_scorer(tiny_dir, tmp_path):
    """Attention-Gate Table 1's measure: zero-shot accuracy with each policy's eviction, the gate at its own and
    the baselines at a fixed 50 % (`--ratio 0.5`): a baseline holds floor(n / 2) of an n-token context (BOS
    included), the gate what its flags kept, measured from the cache."""
    import json

    from kvjax.experiments import zeroshot
    from kvjax.gate import save_gates

    save_gates(_gated(tiny_dir), tmp_path / "g")
    items = [{"context": "the cat sat on the mat " * 6, "query": " where?", "choices": [" mat", " hat"], "gold": 0}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    assert zeroshot.main(["--model", str(tiny_dir), "--gate-params", str(tmp_path / "g"), "--data",
                          str(tmp_path / "t.jsonl"), "--compare", "gate,streaming,h2o-prefill", "--ratio", "0.5",
                          "--out", str(tmp_path / "o")]) == 0
    res = json.loads((tmp_path / "o" / "results.json").read_text())["results"]
    n = 1 + len(load(tiny_dir).tokenizer(items[0]["context"], add_special_tokens=False)["input_ids"])
    for baseline in ("streaming", "h2o-prefill"):
        assert res[baseline]["kv_share"] == pytest.approx((n // 2) / n)
    gate = res["gate"]["kv_share"]
    assert 0 < gate < 1 and gate != pytest.approx((n // 2) / n)


def _stretches(rows: np.ndarray, k: int) -> set[bytes]:
    """Every k-token stretch inside the windows `rows`."""
    return {r[i : i + k].tobytes() for r in rows for i in range(rows.shape[1] - k + 1)}


@pytest.mark.parametrize("as_file", [False, True], ids=["default-text", "data-file"])
def test_identity_train_and_eval_windows_never_overlap(tiny_dir, tmp_path, monkeypatch, as_file):
    """`train_gate` and `eval_gate` with their default options (the default text, or the same text as --data;
    256-token windows, their default numbers of held-out windows) read disjoint text: no 128-token stretch of a
    window evaluation scores
    occurs in a window training reads (the tiny model's tokens are bytes: 128 characters, longer than the
    sentences a text repeats by chance). The windows are the ones the two commands hand to training and to
    evaluation. Before 2026-11-27 training held out the last 16 windows of the text and evaluation scored the
    last 32, so 16 scored windows had been trained on; and pydoc repeats whole topics inside others."""
    from kvjax.experiments import eval_gate, train_gate
    from kvjax.experiments.common import default_text
    from kvjax.models import load as load_lm

    class Stop(Exception):
        pass

    stream = load_lm(tiny_dir).tokenizer(default_text(), add_special_tokens=False)["input_ids"]
    seen = {}

    def fake_train(model, batch, loss, cfg, out, **kw):
        # the batches cycle through every training window: as many as the text has windows reach them all
        rows = [np.asarray(batch(i)["tokens"]) for i in range(len(stream) // 256 + 1)]
        seen["train"] = np.unique(np.concatenate(rows), axis=0)
        raise Stop

    def fake_evaluate(model, tokens, *a, **kw):
        seen["eval"] = np.asarray(tokens)
        raise Stop

    monkeypatch.setattr(train_gate, "train", fake_train)
    monkeypatch.setattr(eval_gate, "evaluate", fake_evaluate)
    data = []
    if as_file:
        (tmp_path / "text.txt").write_text(default_text())
        data = ["--data", str(tmp_path / "text.txt")]
    with pytest.raises(Stop):
        train_gate.main(["--model", str(tiny_dir), "--mode", "cpt", "--out", str(tmp_path / "g"), *data])
    gates = tmp_path / "gates"
    save_gates(_gated(tiny_dir), gates)
    with pytest.raises(Stop):
        eval_gate.main(["--model", str(tiny_dir), "--gate-params", str(gates), "--out", str(tmp_path / "e"), *data])
    assert len(seen["eval"]) == 32 and len(seen["train"]) > 32
    shared = _stretches(seen["eval"], 128) & _stretches(seen["train"], 128)
    assert not shared, f"{len(shared)} stretches of 128 scored tokens were trained on"


def test_identity_a_combination_that_would_score_trained_text_is_one_error(tiny_dir, tmp_path, capsys):
    """More held-out windows than the held-out fifth of --data holds (more would be trained-on text), and gates
    trained under the old rule (all of their text) evaluated on that text, by eval_gate, zeroshot or perplexity:
    each one line, exit 2, naming the options. The data: 10 lines of 100 characters (bytes: tokens), so the held-out fifth is 2 lines, 202
    tokens with their line ends: 3 windows of 64."""
    from kvjax.experiments import cli, eval_gate, train_gate
    from kvjax.experiments.common import SPLIT_RULE, trained_on_scored_text
    from kvjax.experiments.records import content_fingerprint

    data = tmp_path / "data.txt"
    data.write_text("".join(f"{i}" * 100 + "\n" for i in range(10)))
    code = cli.run(train_gate.main, ["--model", str(tiny_dir), "--mode", "cpt", "--out", str(tmp_path / "g"),
                                     "--data", str(data), "--seq-len", "64", "--eval-windows", "4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert err.startswith("error: --eval-windows 4 with --seq-len 64: the held-out part of --data") and \
        "has 3 windows of 64 tokens" in err and "ask for at most 3" in err
    gates = tmp_path / "gates"
    save_gates(_gated(tiny_dir), gates)
    (gates / "training").mkdir()
    old = {"--data": [str(data)], "--data content": [content_fingerprint(data)]}
    (gates / "training" / "train_identity.json").write_text(json.dumps(old))
    argv = ["--model", str(tiny_dir), "--gate-params", str(gates), "--data", str(data), "--seq-len", "64",
            "--windows", "3", "--out", str(tmp_path / "e")]
    assert cli.run(eval_gate.main, argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--gate-params {gates} with --data {data}: the gates were trained on all" in err
    # the same gates under the split rule: evaluation on the held-out windows is theirs to run
    split = old | {"held-out text": SPLIT_RULE}
    assert trained_on_scored_text(split, [str(data)]) is None
    assert "shares a file" in trained_on_scored_text(split, [str(data), str(data)])
    assert "reads all of it" in trained_on_scored_text(split, [str(data)], held_out_only=False)  # a suite's --text
    assert trained_on_scored_text(split, None, held_out_only=False) is None  # the default text's held-out part
    assert "trained on all" in trained_on_scored_text({"--data": None}, None, held_out_only=False)
    # gates trained on the default text before the split read the held-out topics that the zero-shot task's
    # passages and perplexity's default text come from: Table 1's protocol on them is refused too
    (gates / "training" / "train_identity.json").write_text(json.dumps({"--data": None}))
    from kvjax.experiments import perplexity, zeroshot

    for main, flag in ((zeroshot.main, "--data"), (perplexity.main, "--text")):
        assert cli.run(main, ["--model", str(tiny_dir), "--gate-params", str(gates), "--compare", "full,gate",
                              "--out", str(tmp_path / flag)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"with {flag} (default): the gates were trained on all of that text" in err
