"""Tiny randomly initialised checkpoints and an offline byte-level tokenizer.

Used by the tests and by the main job until a trained default model exists.
Everything here is built locally: no hub, no network.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from kvjax.rope import RopeConfig
from kvjax.models.llama import Llama, LlamaConfig
from kvjax.models.loading import save_pretrained

SPECIAL = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3
RANDOM_MARKER = "kvjax_random_init"


def byte_tokenizer():
    """A `transformers` fast tokenizer over the 256 bytes (ids 4..259) + 4 specials.

    Byte-level BPE with no merges: any text round-trips, vocabulary 260.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab.update({ch: i + len(SPECIAL) for i, ch in enumerate(sorted(alphabet))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def tiny_config(**overrides) -> LlamaConfig:
    base = dict(
        vocab_size=len(SPECIAL) + 256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope=RopeConfig(theta=10000.0),
        bos_token_id=1,
        eos_token_ids=(2,),
        pad_token_id=3,
    )
    base.update(overrides)
    return LlamaConfig(**base)


def make_random_checkpoint(
    path: str | Path, cfg: LlamaConfig | None = None, *, seed: int = 0, dtype=jnp.float32, init_std: float = 0.02
) -> Path:
    """Saves a randomly initialised Llama + byte tokenizer as a HF directory, marked as random.

    A larger `init_std` (e.g. 0.3) gives peaked attention, so tests of eviction rules
    see scores that differ between tokens.
    """
    cfg = cfg or tiny_config()
    model = Llama(cfg, dtype=dtype, rngs=nnx.Rngs(seed), init_std=init_std)
    path = save_pretrained(model, path, tokenizer=byte_tokenizer())
    cfg_file = path / "config.json"
    data = json.loads(cfg_file.read_text())
    data[RANDOM_MARKER] = True  # extra keys are kept by AutoConfig and shown by the main job
    cfg_file.write_text(json.dumps(data, indent=2))
    return path


def is_random(path: str | Path) -> bool:
    cfg_file = Path(path) / "config.json"
    return cfg_file.is_file() and bool(json.loads(cfg_file.read_text()).get(RANDOM_MARKER))
