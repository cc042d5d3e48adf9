"""Loading errors name the bad value; nothing touches the network."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kvjax.models import load
from kvjax.models.tiny import byte_tokenizer, is_random, make_random_checkpoint, tiny_config


@pytest.fixture
def ckpt(tmp_path):
    return make_random_checkpoint(tmp_path / "m", tiny_config(num_layers=1))


def _edit_weights(path, fn):
    f = path / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f), metadata={"format": "pt"})


def test_roundtrip_with_tokenizer(ckpt):
    lm = load(ckpt)
    assert is_random(ckpt)
    assert lm.tokenizer is not None and lm.tokenizer.decode(lm.tokenizer("kv ü")["input_ids"]) == "kv ü"
    assert lm.config.num_layers == 1


def test_unknown_model_type(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unknown model_type 'gpt2'.*supports \['baichuan', 'gemma2', 'gemma3_text', 'llama', 'mistral', 'phi3', "
                                         r"'qwen2', 'qwen3'\]"):
        load(ckpt)


def test_missing_weight_is_named(ckpt):
    _edit_weights(ckpt, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(KeyError, match=r"'model.layers.0.mlp.up_proj.weight' is missing"):
        load(ckpt)


def test_shape_mismatch_names_tensor_and_shapes(ckpt):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)

    _edit_weights(ckpt, shrink)
    with pytest.raises(
        ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' in model.safetensors has shape \(16, 64\), but config.json implies \(32, 64\)"
    ):
        load(ckpt)


def test_no_weights_and_no_config(tmp_path, ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights in"):
        load(ckpt)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(tmp_path / "nowhere")


@pytest.fixture
def no_network(monkeypatch):
    """Fails any socket connection; returns the list of attempts."""
    attempts = []

    def refuse(self, *a, **k):
        attempts.append(a)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: refuse(None, *a))
    return attempts


def test_hub_id_not_cached_is_an_error_without_network(tmp_path, monkeypatch, no_network):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match=r"'meta-llama/Llama-2-7b-hf' is not a local directory and is not in the local Hugging Face cache"):
        load("meta-llama/Llama-2-7b-hf")
    assert no_network == []


def test_hub_id_in_the_local_cache_loads(tmp_path, monkeypatch, no_network, ckpt):
    """A hub id resolves to its snapshot in the local cache, offline."""
    import shutil

    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--someone--tiny"
    shutil.copytree(ckpt, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    lm = load("someone/tiny")
    assert lm.path == repo / "snapshots" / "0123abcd" and lm.config.num_layers == 1
    assert no_network == []


def test_byte_tokenizer_covers_every_byte():
    tok = byte_tokenizer()
    text = "ascii, ünïcødé, 漢字, \x00\x7f"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert len(tok) == 260
