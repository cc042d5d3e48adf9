"""KVzap (`kvjax.policies.KVzap`, `kvjax.surrogate`): kept positions equal to kvpress 0.5.5's
`DMSPress(KVzapPress(...))` given the same surrogate weights (kvjax's, written into kvpress's `KVzapModel`), in the
prompt and while decoding; the surrogate's orbax round trip; batch rows alone; refusals."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import kept_sets
from kvjax.errors import InvalidInput, MissingFile
from kvjax.policies import KVzap, make_policy
from kvjax.surrogate import Surrogate, load
from tests.conftest import left_pad, sdpa_llama, stepper

T, D, KVH, LAYERS = 90, 64, 2, 3


def random_surrogate(kind: str, seed: int = 0, hidden: int = 16) -> Surrogate:
    """Zero biases and symmetric weights: about half the scores fall below a threshold of 0."""
    rng = np.random.RandomState(seed)
    if kind == "linear":
        layers = [{"w": rng.randn(D, KVH) / 8, "b": np.zeros(KVH)} for _ in range(LAYERS)]
    else:
        layers = [{"w1": rng.randn(D, hidden) / 8, "b1": rng.randn(hidden) / 4, "w2": rng.randn(hidden, KVH),
                   "b2": np.zeros(KVH)} for _ in range(LAYERS)]
    return Surrogate(kind, tuple(layers))


@pytest.fixture(scope="module")
def sdpa_pair(tmp_path_factory):
    return sdpa_llama(tmp_path_factory.mktemp("kvzap"), seed=2, input_norm_noise=0.5)


def kvpress_press(monkeypatch, surrogate: Surrogate, threshold: float, window: int, decoding: bool):
    """kvpress's DMSPress(KVzapPress) whose surrogate is `surrogate`'s weights in kvpress's KVzapModel (kvpress
    downloads nvidia/KVzap-*; the download is replaced by this model)."""
    import torch
    from kvpress import DMSPress, KVzapPress
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

    hidden = None if surrogate.kind == "linear" else surrogate.layers[0]["w1"].shape[1]
    theirs = KVzapModel(KVzapConfig(input_dim=D, output_dim=KVH, n_modules=LAYERS, hidden_dim=hidden))
    theirs.load_state_dict({k: torch.tensor(v) for k, v in surrogate.to_kvpress().items()})
    monkeypatch.setattr(KVzapModel, "from_pretrained", classmethod(lambda cls, name: theirs))
    return DMSPress(KVzapPress(model_type=surrogate.kind), threshold=threshold, sliding_window_size=window,
                    decoding=decoding)


def kvpress_kept(pt, n: int) -> list[list[list[int]]]:
    """Per layer and KV head, the positions (of n) kvpress's press left unmasked."""
    out = []
    for layer in pt.model.layers:
        masked = layer.self_attn.masked_key_indices
        gone = set() if masked is None else {(int(h), int(s)) for _, h, s in zip(*masked)}
        out.append([[p for p in range(n) if (h, p) not in gone] for h in range(KVH)])
    return out


@pytest.mark.parametrize("kind, window, decoding", [("linear", 16, False), ("mlp", 16, True), ("linear", 0, True)],
                         ids=["linear-prompt-only", "mlp-decoding", "linear-no-window-decoding"])
def test_kept_positions_and_logits_match_kvpress_given_the_same_surrogate(sdpa_pair, monkeypatch, kind, window,
                                                                         decoding):
    """The prompt's kept positions per layer and KV head equal those kvpress's DMSPress(KVzapPress) leaves unmasked,
    then (`decoding`) after each of 24 decoded tokens too, with the next-token logits equal at every step."""
    import torch
    from transformers import DynamicCache

    pt, model = sdpa_pair
    surrogate = random_surrogate(kind)
    ids = np.random.RandomState(4).randint(4, 97, T + 24)
    press = kvpress_press(monkeypatch, surrogate, 0.0, window, decoding)
    pol = KVzap(surrogate=surrogate, threshold=0.0, window=window, decoding=decoding)
    prefill, decode = stepper(model, pol, 128 + 24)
    _, cache = prefill(*left_pad(ids[:T].tolist(), 128))
    cache_pt = DynamicCache()
    with torch.no_grad(), press(pt):
        pt.model(input_ids=torch.tensor(ids[None, :T]), past_key_values=cache_pt)
        assert kept_sets(cache) == kvpress_kept(pt, T)
        kept = sum(len(h) for layer in kept_sets(cache) for h in layer)
        assert 0.3 * 6 * T < kept < 0.8 * 6 * T  # a real share of the pairs went, and a real share stayed
        if not decoding:
            return
        for i in range(T, T + 24):
            theirs = pt(torch.tensor([[ids[i]]]), past_key_values=cache_pt, position_ids=torch.tensor([[i]])).logits
            ours, cache = decode(jnp.asarray([ids[i]], jnp.int32), jnp.asarray([i], jnp.int32), cache)
            np.testing.assert_allclose(np.asarray(ours[0]), theirs[0, -1].numpy(), atol=1e-4, rtol=0)
            assert kept_sets(cache) == kvpress_kept(pt, i + 1), f"after position {i}"
    assert any(p >= T for layer in kept_sets(cache) for h in layer for p in h)  # decoded tokens are cached
    judged = [p for layer in kept_sets(cache) for h in layer for p in h if T <= p < T + 24 - window]
    assert len(judged) < 6 * (24 - window)  # and decoded tokens leaving the window were judged too


def test_the_surrogate_round_trips_through_orbax_and_refuses_a_mixed_copy(tmp_path):
    s = random_surrogate("mlp", seed=3)
    s.save(tmp_path / "z", info={"trained": "here"})
    got, meta = load(tmp_path / "z")
    assert got == s and hash(got) == hash(s) and meta["trained"] == "here" and meta["kind"] == "mlp"
    assert got != random_surrogate("mlp", seed=4)
    np.testing.assert_array_equal(got.layers[2]["w2"], s.layers[2]["w2"])
    random_surrogate("mlp", seed=4).save(tmp_path / "other")
    import shutil

    shutil.rmtree(tmp_path / "z" / "params")
    shutil.copytree(tmp_path / "other" / "params", tmp_path / "z" / "params")
    with pytest.raises(InvalidInput, match="digest|partial or damaged copy"):  # its files' sizes, or its weights
        load(tmp_path / "z")
    with pytest.raises(MissingFile, match="not a KVzap surrogate"):
        load(tmp_path / "absent")


def test_rows_of_a_batch_keep_what_each_keeps_alone(sdpa_pair):
    """Two prompts of different lengths in one batch (left padded): each row's kept prompt positions are those it
    keeps alone, the window counted from each row's own last token."""
    from kvjax.generate import generate

    _, model = sdpa_pair
    pol = KVzap(surrogate=random_surrogate("linear", seed=5), threshold=0.0, window=8, decoding=True)
    rng = np.random.RandomState(6)
    prompts = [rng.randint(4, 97, n).tolist() for n in (70, 41)]
    both = generate(model, prompts, pol, max_new_tokens=12)
    for row, ids in enumerate(prompts):
        alone = generate(model, [ids], pol, max_new_tokens=12)
        assert kept_sets(both.cache, row) == kept_sets(alone.cache)
        assert both.sequences()[row] == alone.sequences()[0]


def test_refusals(tmp_path):
    s = random_surrogate("linear")
    with pytest.raises(InvalidInput, match="dense"):
        KVzap(surrogate=s, threshold=0.0, prefill_mode="chunked", chunk=16)
    with pytest.raises(InvalidInput, match="threshold=nan"):
        KVzap(surrogate=s, threshold=float("nan"))
    with pytest.raises(InvalidInput, match="surrogate has 3 layers"):
        KVzap(surrogate=s, threshold=0.0).check(4, 2)
    with pytest.raises(InvalidInput, match=r"--threshold"):
        make_policy("kvzap", kvzap=s)
    with pytest.raises(InvalidInput, match=r"--kvzap DIR"):
        make_policy("kvzap", threshold=-4.0)
    with pytest.raises(InvalidInput, match="non-finite"):
        Surrogate("linear", ({"w": np.full((D, KVH), np.nan), "b": np.zeros(KVH)},))
    assert "KVzap(surrogate=linear:" in make_policy("kvzap", kvzap=s, threshold=-1.5).describe()


# ---- training (kvjax.kvzap) ----


def test_collect_reads_the_attention_inputs_transformers_computes_and_kvzip_plus_scores_kvpress_ranks(
        sdpa_pair, monkeypatch):
    """`collect`'s inputs are each layer's normed hidden states as transformers computes them; its targets, the log
    KVzip+ scores, evict (at ratio 0.5, `kvzip.evicted`) exactly what kvpress's KVzipPress(kvzip_plus_normalization)
    masks."""
    import torch
    from transformers import DynamicCache

    import kvpress
    from kvjax import kvzap, kvzip
    from kvjax.policies import KVzip
    from tests.test_kvzip import CONTINUE, REPEAT, SUFFIX, kvpress_kept, stub_replay_tokenizer

    pt, model = sdpa_pair
    ids = np.random.RandomState(9).randint(13, 97, 100)
    pol = KVzip(ratio=0.5, repeat_ids=REPEAT, continue_ids=CONTINUE, suffix_ids=SUFFIX, plus=True)
    x, y = kvzap.collect(model, ids[None], pol)
    assert x.shape == (100, LAYERS, D) and y.shape == (100, LAYERS, KVH)
    with torch.no_grad():
        states = pt.model(input_ids=torch.tensor(ids[None]), output_hidden_states=True).hidden_states
        for i, layer in enumerate(pt.model.layers):
            np.testing.assert_allclose(x[:, i], layer.input_layernorm(states[i])[0].numpy(), atol=1e-5, rtol=1e-5)
    stub_replay_tokenizer(monkeypatch)
    with torch.no_grad(), kvpress.KVzipPress(compression_ratio=0.5, kvzip_plus_normalization=True)(pt):
        pt.model(input_ids=torch.tensor(ids[None]), past_key_values=DynamicCache())
    gone = kvzip.evicted(np.exp(y).transpose(1, 2, 0), pol)
    assert [[[p for p in range(100) if not gone[i, h, p]] for h in range(KVH)] for i in range(LAYERS)] == \
        kvpress_kept(pt)
    few, _ = kvzap.collect(model, ids[None], pol, per_context=10, seed=1)
    assert few.shape == (10, LAYERS, D) and all(any(np.allclose(r, s) for s in x[:, 0]) for r in few[:, 0])


def test_ridge_by_hand():
    # x = 0, 1, 2 and y = x: centred, w = (x.y) / (x.x + alpha) = 2 / (2 + 1), b = mean(y) - w mean(x) = 1 / 3
    from kvjax import kvzap

    s = kvzap.fit_linear(np.arange(3.0).reshape(3, 1, 1), np.arange(3.0).reshape(3, 1, 1), alpha=1.0)
    np.testing.assert_allclose(s.layers[0]["w"], [[2 / 3]], rtol=1e-6)
    np.testing.assert_allclose(s.layers[0]["b"], [1 / 3], rtol=1e-6)


def test_spearman_is_scipys():
    from scipy.stats import spearmanr

    from kvjax import kvzap

    rng = np.random.RandomState(0)
    a = rng.randn(200)
    b = a + rng.randn(200)
    assert kvzap.spearman(a, b) == pytest.approx(spearmanr(a, b).statistic, abs=1e-12)
    assert kvzap.spearman(a, -a) == pytest.approx(-1.0)


def test_the_mlp_learns_a_teachers_scores_and_its_loss_falls():
    """An MLP surrogate trained (optax) on a random MLP teacher's outputs ranks held-out inputs as the teacher does,
    and its validation loss falls; the linear one, fitted to the same data, ranks them worse (the teacher is not
    linear)."""
    from kvjax import kvzap

    teacher = random_surrogate("mlp", seed=7, hidden=8)
    rng = np.random.RandomState(8)
    x, held = rng.randn(4000, LAYERS, D).astype(np.float32), rng.randn(500, LAYERS, D).astype(np.float32)
    y, y_held = kvzap.predict(teacher, x), kvzap.predict(teacher, held)
    mlp, history = kvzap.fit_mlp(x, y, hidden=32, epochs=12, lr=5e-3, batch=256)
    assert history["valid"][-1] < 0.2 * history["valid"][0]
    good = kvzap.rank_correlation(mlp, held, y_held)
    assert good["spearman_mean_per_head"] > 0.9 and good["pairs"] == 500 * LAYERS * KVH
    assert kvzap.rank_correlation(kvzap.fit_linear(x, y), held, y_held)["spearman_mean_per_head"] < \
        good["spearman_mean_per_head"]


def test_the_training_command_writes_both_surrogates_and_resumes(tmp_path, capsys):
    """`kvjax.experiments.train_kvzap` on the embedded model: both surrogates load and run as `--policy kvzap`; a rerun
    asking for more texts collects only the new ones; another --length in the same OUT is refused in one line."""
    from kvjax.experiments import generate as gen_cli
    from kvjax.experiments import train_kvzap

    out = tmp_path / "kz"
    argv = ["--out", str(out), "--heldout-texts", "1", "--length", "128", "--per-text", "16", "--epochs", "2"]
    assert train_kvzap.main(argv + ["--texts", "2"]) == 0
    assert sorted(p.name for p in (out / "data").iterdir()) == ["heldout-0000.npz", "train-0000.npz",
                                                                "train-0001.npz"]
    first = (out / "data" / "train-0000.npz").stat().st_mtime_ns
    assert train_kvzap.main(argv + ["--texts", "3"]) == 0
    assert (out / "data" / "train-0000.npz").stat().st_mtime_ns == first and (out / "data" / "train-0002.npz").is_file()
    text = (out / "results.md").read_text()
    assert "| linear |" in text and "| mlp |" in text and (out / "loss.png").is_file()
    for kind in ("linear", "mlp"):
        s, meta = load(out / kind)
        assert meta["kind"] == kind and meta["texts"] == 3 and s.num_layers == meta["num_layers"]
        capsys.readouterr()
        assert gen_cli.main(["--policy", "kvzap", "--kvzap", str(out / kind), "--threshold", "-5",
                             "--max-new-tokens", "2", "The sky is blue."]) == 0
        assert f"KVzap(surrogate={kind}:{s.digest[:12]}" in capsys.readouterr().out
    from kvjax.experiments.driver import ArgumentError

    with pytest.raises(ArgumentError, match="length"):
        train_kvzap.main(["--out", str(out), "--length", "64"])


def test_the_shipped_surrogates_load_and_fit_their_models():
    """kvjax/models/kvzap/: SmolLM2's (30 layers, 3 KV heads of input 576) and kvjax-small's surrogates load (their digests
    match their kvzap.json), and kvjax-small's runs on the embedded model as `--policy kvzap`, evicting."""
    from pathlib import Path

    from kvjax.experiments.driver import load_model
    from kvjax.generate import generate

    root = Path(__file__).resolve().parents[1] / "kvjax" / "models" / "kvzap"
    for kind in ("linear", "mlp"):
        s, meta = load(root / "smollm2" / kind)
        assert (s.num_layers, s.kv_heads, s.input_dim) == (30, 3, 576) and meta["trained_on"].startswith("SmolLM2")
        assert meta["heldout"]["spearman_all_pairs"] > 0.5
    lm = load_model()
    s, meta = load(root / "kvjax-small" / "mlp")
    pol = KVzap(surrogate=s, threshold=meta["heldout"]["threshold_evicting"]["0.5"], window=16)
    ids = lm.tokenizer("The grass is green. The sky is blue. " * 12)["input_ids"]
    out = generate(lm.model, [ids], pol, max_new_tokens=2)
    assert 0.2 < float(out.held_fraction[0]) < 0.95


def test_a_surrogate_predicting_nan_gives_no_correlation():
    from kvjax import kvzap
    from kvjax.errors import NonFiniteError

    s = random_surrogate("linear")
    x = np.full((4, LAYERS, D), np.nan, np.float32)
    with pytest.raises(NonFiniteError, match="non-finite"):
        kvzap.rank_correlation(s, x, np.zeros((4, LAYERS, KVH), np.float32))
