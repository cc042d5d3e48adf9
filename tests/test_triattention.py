"""TriAttention against its reference code (WeianMao/triattention): the trigonometric score of a hand-worked case,
computed by the reference's own `pruning_utils` functions (values below); the z-score and the group's max against a
transcription; the query centres against transformers' pre-RoPE queries; the schedule and the memory held."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention
from kvjax import cache as kvcache
from kvjax.errors import InvalidInput
from kvjax.policies import Context, make_policy
from kvjax.policies.triattention import QueryCentres, TriAttention, calibrate, rope_frequencies, triattention


def centres_of(qbar, abs_mean, omega, layers=1):
    """`QueryCentres` of one layer (repeated) from complex means `[heads, F]`."""
    qbar, abs_mean = np.atleast_2d(qbar), np.atleast_2d(abs_mean)
    rep = lambda a: np.repeat(np.asarray(a, np.float32)[None], layers, 0)  # noqa: E731
    return QueryCentres(mean_re=rep(qbar.real), mean_im=rep(qbar.imag), abs_mean=rep(abs_mean),
                        omega=rep(omega), scale=np.ones(layers, np.float32))


def rotate(k, pos, omega):
    """RoPE's half layout: frequency f of `k` `[..., d]` turned by `pos * omega_f`."""
    half = k.shape[-1] // 2
    z = (k[..., :half] + 1j * k[..., half:]) * np.exp(1j * np.asarray(pos)[..., None] * omega)
    return np.concatenate([z.real, z.imag], -1).astype(np.float32)


def test_triattention_score_of_a_hand_worked_case_is_the_reference_codes():
    """d = 4 (two frequencies), offsets {1, 2, 4}, keys at positions 3 and 4 scored when 5 tokens are read: the
    reference's `compute_frequency_scaled_scores` gives 2.27116 and 2.46879 (run on its `pruning_utils`)."""
    omega = np.array([1.0, 0.01])
    c = centres_of(np.array([1 + 0j, 0 + 1j]), np.array([2.0, 1.5]), omega)
    rule = TriAttention(budget=2, observation_window=0, offsets=4, centres=c, normalize=False)
    keys = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, -1.0, 2.0, 0.0]])  # pre-RoPE
    pos = np.array([3, 4])
    k = jnp.asarray(rotate(keys, pos, omega)[None, None])  # cached rotated: [1, 1, 2, 4]
    got = np.asarray(rule.score(0, k, k, jnp.asarray(pos[None], jnp.int32), None))[0, 0]
    np.testing.assert_allclose(got, [2.27116, 2.46879], atol=2e-5)


def test_triattention_z_scores_each_query_head_then_takes_the_groups_max():
    """Two query heads on one KV head: each head's scores z-scored over the cache, the max of the two (the
    reference's `per_layer_perhead_pruning`), against a NumPy transcription of the formula."""
    rng = np.random.default_rng(0)
    half, n = 4, 12
    omega = 10000.0 ** (-np.arange(half) / half)
    qbar = rng.normal(size=(2, half)) + 1j * rng.normal(size=(2, half))
    abs_mean = np.abs(qbar) + rng.random((2, half))
    rule = TriAttention(budget=4, observation_window=0, offsets=64, centres=centres_of(qbar, abs_mean, omega))
    keys = rng.normal(size=(n, 2 * half))
    pos = np.arange(n) * 3
    k = jnp.asarray(rotate(keys, pos, omega)[None, None])
    got = np.asarray(rule.score(0, k, k, jnp.asarray(pos[None], jnp.int32), None))[0, 0]
    kc = keys[:, :half] + 1j * keys[:, half:]
    shifts = 2.0 ** np.arange(7)
    rows = []
    for h in range(2):
        amp = np.abs(qbar[h]) * np.abs(kc)
        phi = np.angle(qbar[h] * np.conj(kc))
        delta = pos.max() + 1 - pos[:, None] + shifts[None]  # [n, D]
        base = (amp[:, None] * np.cos(delta[..., None] * omega + phi[:, None])).sum(-1).mean(-1)
        s = base + ((abs_mean[h] - np.abs(qbar[h])) * np.abs(kc)).sum(-1)
        rows.append((s - s.mean()) / max(s.std(), 1e-6))
    np.testing.assert_allclose(got, np.max(rows, 0), rtol=1e-4, atol=1e-4)


def test_triattention_centres_are_transformers_pre_rope_query_means(tmp_path):
    """`calibrate` on a random Llama: each layer's per-head mean pre-RoPE query (transformers' q_proj output, hooked)
    and mean magnitude per frequency; RoPE's frequencies are transformers' `inv_freq`."""
    torch = pytest.importorskip("torch")
    from tests.conftest import sdpa_llama

    pt, model = sdpa_llama(tmp_path / "m", seed=3)
    ids = np.random.default_rng(4).integers(0, 97, 50)
    seen = []
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.append(o[0].detach().numpy()))
             for layer in pt.model.layers]
    with torch.no_grad():
        pt(torch.tensor(ids[None]))
    for h in hooks:
        h.remove()
    c = calibrate(model, ids.tolist())
    d = model.cfg.head_dim
    for layer, q in enumerate(seen):
        q = q.reshape(len(ids), -1, d)  # [t, heads, d]
        z = q[..., : d // 2] + 1j * q[..., d // 2:]
        np.testing.assert_allclose(c.mean_re[layer] + 1j * c.mean_im[layer], z.mean(0), atol=1e-5)
        np.testing.assert_allclose(c.abs_mean[layer], np.abs(z).mean(0), atol=1e-5)
    np.testing.assert_allclose(c.omega[0], pt.model.rotary_emb.inv_freq.numpy(), rtol=1e-5)
    assert c.scale[0] == pytest.approx(1.0)
    c.save(tmp_path / "c.npz")
    assert QueryCentres.load(tmp_path / "c.npz") == c
    assert "sha256:" + c.digest in make_policy("triattention", 16, centres=str(tmp_path / "c.npz"),
                                               observation_window=4).describe()


def test_triattention_decodes_in_budget_plus_slots_keeping_the_top_scores():
    """`triattention(budget=B, decode_slots=N)` decoding token by token: B + N slots; whenever it holds B + N tokens it
    keeps the latest W and the best B - W by the score of those keys at that step."""
    rng = np.random.default_rng(2)
    kvh, d, steps, B, N, W = 1, 8, 60, 12, 6, 3
    omega = 10000.0 ** (-np.arange(d // 2) / (d // 2))
    qbar = rng.normal(size=(1, d // 2)) + 1j * rng.normal(size=(1, d // 2))
    c = centres_of(qbar, np.abs(qbar) + 0.5, omega)
    policy = triattention(B, c, observation_window=W, offsets=256, decode_slots=N)
    assert policy.capacity(0, 10_000, 0) == B + N
    keys = rng.normal(size=(steps, kvh, d)).astype(np.float32)
    k = rotate(keys, np.arange(steps)[:, None], omega)
    cache = kvcache.empty(1, kvh, B + N, d, jnp.float32, policy.cache_state)

    @jax.jit
    def step(cache, k_t, t):
        ctx = Context(t)
        cache = policy.step(0, cache, k_t, k_t, ctx)
        _, stats = attention.decode_attention(k_t[:, :, None].reshape(1, kvh, d), cache.k, cache.v, cache.pos,
                                              cache.log_w, scale=d**-0.5, stats=policy.stats(0).decode)
        return policy.observe(0, cache, ctx, stats)

    kept = []
    for t in range(steps):
        cache = step(cache, jnp.asarray(k[t][None]), jnp.asarray([t], jnp.int32))
        kept.append(t)
        if len(kept) == B + N:
            kc = keys[kept, 0, : d // 2] + 1j * keys[kept, 0, d // 2:]
            shifts = 2.0 ** np.arange(9)
            delta = t + 1 - np.asarray(kept)[:, None] + shifts[None]
            phi = np.angle(qbar[0] * np.conj(kc))
            s = (np.abs(qbar[0]) * np.abs(kc))[:, None] * np.cos(delta[..., None] * omega + phi[:, None])
            s = s.sum(-1).mean(-1) + (0.5 * np.abs(kc)).sum(-1)
            window = [x for x in kept if x > t - W]
            best = sorted((x for x in kept if x <= t - W), key=lambda x: -s[kept.index(x)])
            kept = sorted(window + best[: B - W])
        assert kvcache.kept_sets((cache,))[0] == [kept], f"step {t}"


def test_triattention_refuses_what_it_cannot_run(tmp_path):
    with pytest.raises(InvalidInput, match="centres"):
        make_policy("triattention", 256)
    with pytest.raises(InvalidInput, match="--centres .*nope.npz"):
        make_policy("triattention", 256, centres=str(tmp_path / "nope.npz"))
    c = centres_of(np.ones((2, 4)), np.ones((2, 4)) * 2, np.ones(4), layers=2)
    with pytest.raises(InvalidInput, match="hold 2 layers of 2 query heads, the model 3 layers"):
        TriAttention(budget=256, centres=c).check(3, 1)
    with pytest.raises(InvalidInput, match="half layout"):
        rope_frequencies(lambda x, p: x[..., ::-1], 8)


def test_triattention_compressing_a_prompt_ranks_each_layer_by_its_own_centres(tmp_path):
    """`recompress(TriAttention)` on a 3-layer model whose layers share one compiled body (a scan over layers): each
    layer keeps its window and its own top scores, the keys scored with that layer's centres (reading layer 0's for
    all of them would keep other positions)."""
    import jax.numpy as jnp

    from kvjax import drive, generate
    from kvjax.policies import recompress
    from tests.conftest import sdpa_llama

    _, model = sdpa_llama(tmp_path / "m", seed=5)
    rng = np.random.default_rng(6)
    c = calibrate(model, rng.integers(0, 97, 200).tolist())
    rule = TriAttention(budget=16, observation_window=4, offsets=1024, centres=c)
    prompt = rng.integers(0, 97, 48).tolist()
    gen = generate(model, [prompt], recompress(rule, 8), max_new_tokens=1, eos_ids=[])
    keys = drive.probe(model, jnp.asarray([prompt], jnp.int32),
                       lambda geom, q, k, pos, hidden: geom.rotate(k, pos[:, None, :]))
    pos = np.arange(48)
    expected, differs = [], False
    for layer, k in enumerate(keys):
        s = np.asarray(rule.score(layer, k, k, jnp.asarray(pos[None], jnp.int32), None))[0]
        s0 = np.asarray(rule.score(0, k, k, jnp.asarray(pos[None], jnp.int32), None))[0]
        pick = lambda s: [sorted(set(np.argsort(-np.where(pos < 44, s[h], -np.inf), kind="stable")[:12])
                                 | set(range(44, 48)))
                          for h in range(s.shape[0])]  # noqa: E731
        expected.append([[int(x) for x in h] for h in pick(s)])
        differs |= pick(s) != pick(s0)
    assert differs  # the layers' centres rank differently, so the check below can tell them apart
    assert kvcache.kept_sets(gen.cache) == expected


def test_calibrate_command_writes_centres_the_policy_reads(tmp_path, capsys):
    """`python -m kvjax.experiments.calibrate_triattention` on the default model: a centres file whose hash the
    policy's description carries; an unwritable --out and an unreadable --text are one-line errors."""
    from kvjax.experiments import calibrate_triattention as cal
    from tests.test_reliability import one_error_line, run_cli

    out = tmp_path / "c.npz"
    assert cal.main(["--out", str(out), "--tokens", "128"]) == 0
    c = QueryCentres.load(out)
    assert f"sha256:{c.digest}" in capsys.readouterr().out
    code, err = run_cli(cal.main, ["--out", str(tmp_path / "no" / "c.npz"), "--tokens", "64"], capsys)
    assert code == 2 and f"--out {tmp_path / 'no' / 'c.npz'}: cannot be written" in one_error_line(err)
    code, err = run_cli(cal.main, ["--out", str(out), "--text", str(tmp_path / "missing.txt")], capsys)
    assert code == 2 and "--text" in one_error_line(err)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(InvalidInput, match="bad.npz: not a TriAttention centres file"):
        QueryCentres.load(tmp_path / "bad.npz")
