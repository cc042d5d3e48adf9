"""The embedded default model (kvjax/models/default, trained by kvjax.experiments.train_tiny): it loads in both
frameworks, uses its context (passkey) and has an attention sink."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.experiments import model_card, passkey
from kvjax.experiments.common import DEFAULT_MODEL_DIR
from kvjax.experiments.records import ResultLog
from kvjax.policies import FullCache, StreamingLLM
from kvjax import drive

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "model.safetensors").is_file(),
                                reason="the default model is not in this checkout")


@pytest.fixture(scope="module")
def default():
    from kvjax.models import load

    return load(DEFAULT_MODEL_DIR)


def test_logits_match_transformers_pytorch(default):
    torch = pytest.importorskip("torch")
    from transformers import LlamaForCausalLM

    text = "def greet(name):\n    return f'Hello, {name}!'\n\nThe pass key is 12345. Remember it."
    ids = default.tokenizer(text)["input_ids"]
    ours = np.asarray(drive.logits(default.model, np.asarray([ids])))
    hf = LlamaForCausalLM.from_pretrained(DEFAULT_MODEL_DIR).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_passkey_full_cache_retrieves_and_streaming_without_the_key_does_not(default, tmp_path):
    n = default.config.max_position_embeddings
    length = n - passkey.MAX_NEW_TOKENS  # the training length, with room for the answer
    log = ResultLog(tmp_path / "p.jsonl")
    full = passkey.run(default.model, default.tokenizer, FullCache(), [length], [0.0, 0.2, 0.4, 0.6, 0.8, 1.0], 4,
                       log, seed=123, label="full", progress=False)
    acc_full = np.mean([r["correct"] for r in full])
    window = StreamingLLM(budget=n // 4, sinks=4)  # sinks + the last n/4 - 4 tokens
    stream = passkey.run(default.model, default.tokenizer, window, [length], [0.0, 0.25, 0.5], 4, log, seed=123,
                         label="streaming", progress=False)
    assert all(r["needle_at"] + 20 < length - (n // 4 - 4) for r in stream)  # the key is outside the window
    acc_stream = np.mean([r["correct"] for r in stream])
    assert acc_full >= 0.9, [r["output"] for r in full if not r["correct"]]
    assert acc_stream <= 0.2


def test_first_token_is_an_attention_sink_in_deep_layers(default):
    from kvjax.experiments.corpus import doc_documents

    tok, n = default.tokenizer, default.config.max_position_embeddings
    text = " ".join(t for _, t in doc_documents("heldout"))
    rows = np.asarray([tok(text[i * 3000 :])["input_ids"][:n] for i in range(2)], np.int32)
    sink = model_card.sink_shares(default.model, rows)
    mean, strongest, uniform = sink["first_token_share"], sink["strongest_head_share"], sink["uniform_share"][0]
    deep = slice(len(mean) // 2, None)
    # A sink is a per-head habit: in every deep layer some head gives the first token > 5x what uniform
    # attention would, and the mean head > 3x (the committed model: 8.8x and 4.7x in layer 1; layer 0: 1.5x)
    assert min(strongest[deep]) > 5 * uniform and min(mean[deep]) > 3 * uniform, sink
