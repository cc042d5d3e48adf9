"""Gemma 3 270M from its GGUF file (issue #86, item 1): `python -m kvjax.models.fetch gemma3-270m`, then
`--model gemma3-270m` everywhere. Its Q5_0 tensors (the file's K-quants are Q4_K and Q6_K, which kvjax already read)
dequantize as ggml's reference code defines the block, transcribed here; its logits and greedy text equal
transformers' (the same file loaded by transformers' GGUF reader). Skipped where the file is not fetched."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.models import fetch

PATH = fetch.cached_path("gemma3-270m")
pytestmark = pytest.mark.skipif(not PATH.is_file(), reason="python -m kvjax.models.fetch gemma3-270m")


def q5_0_reference(raw: np.ndarray) -> np.ndarray:
    """ggml's `dequantize_row_q5_0`, transcribed: blocks of 32 values, each a float16 scale d, 32 high bits qh and 16
    bytes of low nibbles; value j is d * ((low_j | high_j << 4) - 16), the first 16 from the low nibbles."""
    blocks = raw.reshape(-1, 22)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    qh = blocks[:, 2:6].copy().view("<u4")[:, 0]
    qs = blocks[:, 6:22]
    j = np.arange(16)
    x0 = (qs & 0x0F) | ((((qh[:, None] >> j) << 4) & 0x10).astype(np.uint8))
    x1 = (qs >> 4) | (((qh[:, None] >> (j + 12)) & 0x10).astype(np.uint8))
    return (np.concatenate([x0, x1], axis=1).astype(np.float32) - 16) * d


def test_q5_0_tensors_dequantize_as_ggml_defines_them():
    from kvjax.models.gguf import GGUFFile

    f = GGUFFile(PATH)
    t = next(t for t in f.reader.tensors if t.tensor_type.name == "Q5_0" and t.name.endswith("attn_k.weight"))
    name = next(n for n in f.names() if f.source(n) == t.name)
    ours = f.get(name)
    theirs = q5_0_reference(np.asarray(t.data, np.uint8).reshape(-1)).reshape(ours.shape)
    np.testing.assert_array_equal(ours, theirs)


def test_the_config_has_gemmas_local_layers():
    """The file's sliding window (512) on five of every six layers, as transformers' Gemma 3 config lays them out
    (the pattern is not in the file)."""
    from kvjax.models import load

    from transformers import Gemma3TextConfig

    lm = load("gemma3-270m")
    theirs = Gemma3TextConfig(num_hidden_layers=18, sliding_window=512).layer_types  # transformers' own layout
    assert lm.model.cfg.windows == tuple(512 if t == "sliding_attention" else None for t in theirs)
    assert lm.model.cfg.windows.count(None) == 3


@pytest.mark.slow
def test_logits_and_greedy_text_equal_transformers():
    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForCausalLM

    from kvjax import drive, generate
    from kvjax.models import load
    from kvjax.policies import FullCache

    lm = load("gemma3-270m")
    ids = lm.tokenizer("The capital of France is Paris, and the capital of Italy is")["input_ids"]
    pt = AutoModelForCausalLM.from_pretrained(PATH.parent, gguf_file=PATH.name, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = pt(torch.tensor([ids])).logits[0].numpy()
        greedy = pt.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    ours = np.asarray(drive.logits(lm.model, jnp.asarray([ids], jnp.int32))[0])
    np.testing.assert_allclose(ours, theirs, atol=2e-3 * np.abs(theirs).max(), rtol=0)
    assert generate(lm.model, [ids], FullCache(), max_new_tokens=8).sequences()[0][:len(greedy)] == greedy
