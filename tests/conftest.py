from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from pathlib import Path

# The suite compiles hundreds of small programs and runs each a few times: XLA's CPU backend without LLVM's
# optimisation passes compiles them faster (about 20 % of the suite's time) and computes the same IEEE operations.
# Set before jax starts its backend; a user's own XLA_FLAGS are kept.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kvjax.backends  # noqa: E402, F401  (the CPU only on a machine without accelerator: libtpu is installed)
import pytest
from hypothesis import Phase, settings

from kvjax.models.tiny import make_random_checkpoint, tiny_config

# Parity tolerances (1e-4 / 1e-5 in float32) assume true float32 matmuls; GPUs default to
# TF32 for float32 dots, so the suite asks for full precision on every backend.
jax.config.update("jax_default_matmul_precision", "highest")

# Test modules compile some of the same programs again (each module drops its compiled programs, see below, and
# the other xdist worker has its own): jax's persistent compilation cache keeps them on disk (a tenth of the
# suite's time on 2 cores), keyed by the program, the compile options and jax's version, so a hit is the same
# executable; compile-count tests still see every request (jax records its compile event around the cache read).
# A user's own cache setting wins.
if not jax.config.jax_compilation_cache_dir:
    uid = getattr(os, "getuid", lambda: 0)()
    jax.config.update("jax_compilation_cache_dir", str(Path(tempfile.gettempdir()) / f"kvjax-tests-jax-{jax.__version__}-{uid}"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# `pytest --hypothesis-profile=no_shrink`: report the first failing example as found. On a GPU
# every shrinking step recompiles a kernel, so shrinking a compile error takes minutes.
settings.register_profile("no_shrink", phases=[Phase.explicit, Phase.reuse, Phase.generate])


def sdpa_llama(path, *, seed: int, input_norm_noise: float = 0.0):
    """kvpress's test model: a random GQA Llama (hidden 64, 3 layers, 8 query heads on 2 KV heads of size 8) with SDPA
    attention (kvpress's head-wise presses and KVzip refuse eager attention), saved to `path`: (transformers' model,
    kvjax's). `input_norm_noise`: the attention norms' weights drawn around 1 (weights of 1 give every attention input
    the norm sqrt(hidden), which KVzip+ divides by)."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvjax.models import load

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=512, initializer_range=0.2,
                      attn_implementation="sdpa")
    pt = LlamaForCausalLM(cfg).eval()
    if input_norm_noise:
        with torch.no_grad():
            for lay in pt.model.layers:
                lay.input_layernorm.weight.copy_(1 + input_norm_noise * torch.randn(cfg.hidden_size))
    pt.save_pretrained(path)
    return pt, load(path).model


def hf_llama(path, *, seed=0, init_range=0.1, **overrides):
    """A random `transformers` LlamaForCausalLM saved to `path`; returns (torch model, path)."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=init_range,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    with torch.no_grad():  # RMSNorm weights start at 1: perturb them so they are really tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model, path


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program after each test module. Compilations are shared within a module
    (module-scoped fixtures), rarely across modules, and a single process that keeps all of the
    suite's executables grows until XLA's CPU compiler fails (a segfault seen at 97 % of the run)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A kvjax-made random checkpoint (no torch needed): 2 layers, 4 heads, 2 KV heads."""
    return make_random_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_config(), seed=0)


@pytest.fixture(scope="session")
def sharp_dir(tmp_path_factory):
    """A random checkpoint with large weights (std 0.3): peaked attention, O(1) logits, so
    eviction rules see scores that differ and logit comparisons are not between near-zeros."""
    return make_random_checkpoint(tmp_path_factory.mktemp("sharp"), tiny_config(), seed=1, init_std=0.3)


@pytest.fixture(scope="session")
def sharp_mha_dir(tmp_path_factory):
    """As `sharp_dir`, with multi-head attention (4 KV heads)."""
    return make_random_checkpoint(tmp_path_factory.mktemp("sharp_mha"), tiny_config(num_kv_heads=4), seed=2, init_std=0.3)


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from kvjax.models import load

    return load(tiny_dir)


def stepper(model, policy, max_len):
    """Jitted prefill / decode of `model` under `policy` (`kvjax.engine`), for teacher-forced tests."""
    from kvjax import drive, engine

    def prefill(tokens, positions):
        return engine.prefill(model, tokens, positions, plan=drive.plan(model, policy, max_len, tokens.shape[1]))

    def decode(tokens, positions, cache):
        return engine.decode(model, tokens, positions, cache, plan=drive.plan(model, policy, max_len))

    return prefill, decode


def prefill_policy(model, tokens, positions, policy, max_len):
    """A prompt read under `policy`, its cache sized for `max_len` tokens (`kvjax.drive.prompt`, run eagerly)."""
    from kvjax import drive

    return drive.prompt(model, tokens, positions, drive.plan(model, policy, max_len, tokens.shape[1]))


def random_ids(n, vocab, seed=0, low=4):
    return np.random.RandomState(seed).randint(low, vocab, size=n).tolist()


def left_pad(ids, bucket):
    """One prompt as the model takes it: tokens and positions `[1, bucket]`, -1 on padding."""
    import jax.numpy as jnp

    toks = np.zeros((1, bucket), np.int32)
    pos = np.full((1, bucket), -1, np.int32)
    toks[0, bucket - len(ids) :] = ids
    pos[0, bucket - len(ids) :] = np.arange(len(ids))
    return jnp.asarray(toks), jnp.asarray(pos)


@contextlib.contextmanager
def compile_log():
    """XLA compilations (jax's compile events) while the block runs."""
    names = []

    def listener(name, *args, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            names.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
