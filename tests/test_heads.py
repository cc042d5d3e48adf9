"""Retrieval-head detection: planted heads are found, the blocked probe equals dense attention,
selection rules (ratios, GQA groups), the find_heads CLI and its errors."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.experiments import find_heads
from kvjax.experiments import generate as generate_cli
from kvjax import heads as H
from kvjax.rope import RopeConfig
from kvjax.models.llama import Llama
from kvjax.models.tiny import tiny_config

V, HD, D = 40, 64, 96
TOKEN, CONST, PREV = 0, V, V + 1  # residual stream layout: token one-hot, a constant, the previous token
CONTENT = list(range(12, 32)) + list(range(44, 64))  # head dims rotated by < 1e-4 rad over the probe


def planted_model():
    """A 2-layer attention-only Llama with hand-set weights (Olsson et al.'s induction circuit):

    * layer 0 head 0, previous-token head: q and k are constants rotated so that
      q_i . k_j = sum_p cos((j + 1 - i) theta_p) peaks at j = i - 1 (RoPE's high-frequency pairs);
      it copies the previous token's one-hot into the residual stream;
    * layer 1 head 0, induction head: query = current token, key = the token before the key,
      in head dims that RoPE (theta 1e12) barely rotates;
    * layer 1 head 1, echo head: query = key = the current token.
    Every other head and every MLP is zero.
    """
    cfg = tiny_config(vocab_size=V, hidden_size=D, intermediate_size=8, num_heads=4, num_kv_heads=4, head_dim=HD,
                      rope=RopeConfig(theta=1e12), max_position_embeddings=1024)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    zero = lambda p: p.__setitem__(..., jnp.zeros_like(p[...]))
    for layer in model.layers:
        for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                  layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            zero(m.kernel)
    emb = np.zeros((V, D), np.float32)
    emb[np.arange(V), TOKEN + np.arange(V)] = 1.0
    emb[:, CONST] = 1.0
    model.embed_tokens.embedding[...] = jnp.asarray(emb)

    a0, a1 = model.layers[0].self_attn, model.layers[1].self_attn
    theta = 1e12 ** (-np.arange(HD // 2) * 2 / HD)
    u = np.zeros(HD)
    u[:4] = 3.0  # the four fastest-rotating pairs
    k = np.zeros(HD)  # R_1 u
    k[:4], k[HD // 2 : HD // 2 + 4] = u[:4] * np.cos(theta[:4]), u[:4] * np.sin(theta[:4])
    q0, k0, v0 = (np.zeros((D, 4 * HD), np.float32) for _ in range(3))
    o0 = np.zeros((4 * HD, D), np.float32)
    q0[CONST, :HD], k0[CONST, :HD] = u, k
    norm0 = np.sqrt(D / 2)  # RMSNorm of a one-hot + constant embedding
    v0[TOKEN + np.arange(V), np.arange(V)] = 1.0
    o0[np.arange(V), PREV + np.arange(V)] = 1.0 / norm0
    for m, w in ((a0.q_proj, q0), (a0.k_proj, k0), (a0.v_proj, v0), (a0.o_proj, o0)):
        m.kernel[...] = jnp.asarray(w)

    q1, k1 = np.zeros((D, 4 * HD), np.float32), np.zeros((D, 4 * HD), np.float32)
    c = np.asarray(CONTENT)
    q1[TOKEN + np.arange(V), 0 * HD + c] = 2.5  # induction: current token ...
    k1[PREV + np.arange(V), 0 * HD + c] = 2.5  # ... against the key's previous token
    q1[TOKEN + np.arange(V), 1 * HD + c] = 2.5  # echo: current token against the key's token
    k1[TOKEN + np.arange(V), 1 * HD + c] = 2.5
    a1.q_proj.kernel[...], a1.k_proj.kernel[...] = jnp.asarray(q1), jnp.asarray(k1)
    return model


def _probe(k=30):
    return H.probe_tokens(V, k=k, repeats=4, bos_id=1, seed=0, exclude=(0, 2, 3))


def test_planted_heads_are_ranked_first():
    model = planted_model()
    tokens = _probe()
    maps = H.attention_maps(model, jnp.asarray(tokens)[None])
    prev = np.diagonal(maps[0][0, 0], offset=-1)
    assert prev.mean() > 0.95  # the construction works: layer 0 head 0 reads the previous token

    scores = H.head_scores(model, tokens)
    top = lambda m: divmod(int(np.argmax(m)), 4)
    assert top(scores.induction) == (1, 0)
    assert top(scores.echo) == (1, 1)
    assert scores.induction[1, 0] > 0.9 and scores.echo[1, 1] > 0.5
    # Ranked first: the planted head leads every other head by a wide margin.
    assert np.sort(scores.induction.reshape(-1))[-2] < 0.2
    q_mask, kv_mask = H.select_retrieval(scores, num_kv_heads=4, induction_ratio=1 / 8, echo_ratio=1 / 8)
    assert sorted(zip(*np.nonzero(q_mask))) == [(1, 0), (1, 1)]
    np.testing.assert_array_equal(kv_mask, q_mask)


def test_blocked_scores_equal_dense_attention(monkeypatch, tiny):
    """The probe's query-block pass equals sums over the dense attention maps."""
    tokens = H.probe_tokens(260, k=15, repeats=3, bos_id=1, seed=1, exclude=(0, 2, 3))
    monkeypatch.setattr(H, "_BLOCK_ELEMENTS", 4 * 46 * 7)  # 7 queries a block: 46 tokens in 7 blocks
    scores = H.head_scores(tiny.model, tokens)
    maps = H.attention_maps(tiny.model, jnp.asarray(tokens)[None])
    t = len(tokens)
    echo_keys = [[j for j in range(i) if tokens[j] == tokens[i]] for i in range(t)]
    ind_keys = [[j for j in range(1, i) if tokens[j - 1] == tokens[i]] for i in range(t)]
    for layer, p in enumerate(maps):
        for h in range(4):
            e = np.mean([p[0, h, i, js].sum() for i, js in enumerate(echo_keys) if js])
            n = np.mean([p[0, h, i, js].sum() for i, js in enumerate(ind_keys) if js])
            np.testing.assert_allclose(scores.echo[layer, h], e, rtol=1e-5)
            np.testing.assert_allclose(scores.induction[layer, h], n, rtol=1e-5)


def test_selection_ratios_and_gqa_groups():
    ind = np.array([[0.9, 0.1, 0.2, 0.3], [0.05, 0.8, 0.0, 0.4]])
    echo = np.array([[0.0, 0.0, 0.7, 0.0], [0.0, 0.0, 0.0, 0.1]])
    scores = H.HeadScores(echo=echo, induction=ind)
    q, kv = H.select_retrieval(scores, num_kv_heads=2, induction_ratio=0.25, echo_ratio=0.1)
    # top 2 of 8 by induction: (0,0), (1,1); top 1 by echo: (0,2)
    assert sorted(zip(*np.nonzero(q))) == [(0, 0), (0, 2), (1, 1)]
    np.testing.assert_array_equal(kv, [[True, True], [True, False]])  # a group counts if any query head does
    q0, kv0 = H.select_retrieval(scores, 2, 0.0, 0.0)
    assert not q0.any() and not kv0.any()
    for kw in (dict(induction_ratio=1.5), dict(echo_ratio=-0.1)):
        with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
            H.select_retrieval(scores, 2, **kw)


def test_probe_tokens():
    t = H.probe_tokens(40, k=30, repeats=4, bos_id=1, exclude=(0, 2, 3))
    assert len(t) == 121 and t[0] == 1
    seg = t[1:].reshape(4, 30)
    assert (seg == seg[0]).all() and len(set(seg[0])) == 30 and not set(seg[0]) & {0, 1, 2, 3}


def test_find_heads_cli_then_razor_generation(tmp_path, tiny_dir, capsys):
    out = tmp_path / "heads.json"
    assert find_heads.main(["--model", str(tiny_dir), "--out", str(out), "--k", "20", "--induction-ratio", "0.25"]) == 0
    data = json.loads(out.read_text())
    assert (data["num_layers"], data["num_heads"], data["num_kv_heads"]) == (2, 4, 2)
    assert np.asarray(data["echo"]).shape == (2, 4) and np.asarray(data["retrieval_kv_heads"]).shape == (2, 2)
    scores = H.HeadScores(echo=np.asarray(data["echo"]), induction=np.asarray(data["induction"]))
    q, kv = H.select_retrieval(scores, 2, 0.25, 0.01)  # ceil(0.25 * 8) = 2 induction heads + 1 echo head
    assert 2 <= q.sum() <= 3
    np.testing.assert_array_equal(data["retrieval_heads"], q)
    np.testing.assert_array_equal(data["retrieval_kv_heads"], kv)
    assert out.with_suffix(".png").stat().st_size > 1000
    capsys.readouterr()
    assert generate_cli.main(["--model", str(tiny_dir), "--policy", "razor", "--heads", str(out), "--buffer", "4",
                              "--compression", "4", "--max-new-tokens", "8", "a prompt long enough to compress"]) == 0
    assert "RazorAttention(retrieval " in capsys.readouterr().out


def test_find_heads_cli_errors(tmp_path, tiny_dir, capsys):
    with pytest.raises(SystemExit):
        find_heads.main(["--model", str(tiny_dir), "--out", str(tmp_path / "h.json"), "--echo-ratio", "2"])
    assert "--echo-ratio=2.0 must be in [0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        find_heads.main(["--model", str(tiny_dir), "--out", str(tmp_path / "h.json"), "--k", "5000"])
    assert "pass a smaller --k" in capsys.readouterr().err


def test_attention_logits_are_q_dot_k_over_sqrt_d_and_softmax_to_the_maps(tiny):
    tokens = jnp.asarray([[1, 50, 60, 70, 80, 90]])
    logits = H.attention_maps(tiny.model, tokens, logits=True)
    probs = H.attention_maps(tiny.model, tokens)
    for lg, p in zip(logits, probs):
        assert np.isneginf(lg[0, :, 0, 1:]).all()  # causal: masked
        e = np.exp(lg - lg.max(-1, keepdims=True))
        np.testing.assert_allclose(e / e.sum(-1, keepdims=True), p, atol=1e-6)
    # layer 0 by hand: RMSNorm -> q/k projections -> RoPE, then q.k / sqrt(d)
    layer0 = tiny.model.layers[0]
    q, k, _ = layer0.self_attn.qkv(layer0.input_layernorm(tiny.model.embed(tokens)))
    pos = jnp.arange(tokens.shape[1])[None, None, :]
    q, k = layer0.self_attn.geometry(0).rotate(q, pos), layer0.self_attn.geometry(0).rotate(k, pos)
    d = tiny.config.head_dim
    want = np.einsum("hd,d->h", np.asarray(q[0, :, 5]), np.asarray(k[0, 0, 2])) / np.sqrt(d)
    np.testing.assert_allclose(logits[0][0, :2, 5, 2], want[:2], rtol=1e-5)  # heads 0-1 share KV head 0
