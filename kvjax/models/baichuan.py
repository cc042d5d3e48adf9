"""Baichuan / Baichuan2, read from config.json and mapped tensor by tensor (no remote code).

The architecture is the Llama decoder (MHA, RMSNorm, SwiGLU) with:

* `self_attn.W_pack.weight` `[3 * hidden, hidden]`: q, k and v projections stacked in that order;
* Baichuan2's NormHead: logits use the L2-normalised rows of `lm_head.weight`. At inference the
  normalisation is constant, so it is applied once when loading (as vLLM does), not every step;
* the 7B layouts use RoPE (base 10000); the 13B layouts use ALiBi with the slopes of
  Press et al. (`kvjax.attention.alibi_slopes`, interleaved for head counts like 40) and no RoPE.

Which layout a config.json describes is not written in it explicitly. Our rule: a
`position_embedding` key ("rope" / "alibi", kvjax's own) wins; otherwise a config with
`max_position_embeddings` is the 7B layout (Baichuan-7B and Baichuan2-7B ship it) and one with
only `model_max_length` is the 13B layout. NormHead is on unless the vocabulary is Baichuan v1's
64000 (vLLM uses Baichuan2's 125696 the same way); `norm_head` in config.json overrides it.
"""

from __future__ import annotations

import numpy as np

from kvjax.errors import InvalidInput
from kvjax.rope import RopeConfig
from kvjax.models.llama import LlamaConfig

BAICHUAN_V1_VOCAB = 64000


def config_from_json(d: dict) -> LlamaConfig:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: kvjax's Baichuan supports only 'silu'")
    heads = d["num_attention_heads"]
    if "position_embedding" in d:
        pe = d["position_embedding"]
    else:
        pe = "rope" if "max_position_embeddings" in d else "alibi"
    eos = d.get("eos_token_id", 2)
    return LlamaConfig(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=d["hidden_size"] // heads,
        max_position_embeddings=d.get("max_position_embeddings") or d.get("model_max_length", 4096),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope=RopeConfig(theta=float(d.get("rope_theta", 10000.0))),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id", 1),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
        pad_token_id=d.get("pad_token_id", 0),
        position_embedding=pe,
        model_type="baichuan",
    )


def norm_head(d: dict) -> bool:
    return bool(d.get("norm_head", d["vocab_size"] != BAICHUAN_V1_VOCAB))


class BaichuanTensors:
    """Presents a Baichuan checkpoint under the Llama names the generic loader expects:
    `W_pack` split into q/k/v, `lm_head` rows normalised for NormHead."""

    _QKV = ("q_proj", "k_proj", "v_proj")

    def __init__(self, inner, cfg: LlamaConfig, normalise_head: bool):
        self.inner, self.cfg, self.normalise_head = inner, cfg, normalise_head
        self.files = inner.files

    def source(self, name: str) -> str:
        """The checkpoint tensor a Llama-named tensor comes from."""
        for p in self._QKV:
            if name.endswith(f"self_attn.{p}.weight"):
                return name.replace(f"{p}.weight", "W_pack.weight")
        return name

    def names(self) -> set[str]:
        out = set()
        for n in self.inner.names():
            if n.endswith("self_attn.W_pack.weight"):
                out |= {n.replace("W_pack", p) for p in self._QKV}
            else:
                out.add(n)
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        src = self.source(name)
        if src == name:
            return self.inner.shape(name)
        want = (3 * self.cfg.hidden_size, self.cfg.hidden_size)
        got = self.inner.shape(src)
        if got != want:
            raise InvalidInput(f"weight {src!r} in {self.inner.file(src).name} has shape {got}, but config.json implies {want}")
        return (self.cfg.hidden_size, self.cfg.hidden_size)

    def file(self, name: str):
        return self.inner.file(self.source(name))

    def get(self, name: str) -> np.ndarray:
        src = self.source(name)
        arr = self.inner.get(src)
        if src != name:
            h = self.cfg.hidden_size
            i = [p for p in self._QKV if f".{p}." in name][0]
            return arr[self._QKV.index(i) * h : (self._QKV.index(i) + 1) * h]
        if name == "lm_head.weight" and self.normalise_head:
            a32 = arr.astype(np.float32)
            return (a32 / np.maximum(np.linalg.norm(a32, axis=1, keepdims=True), 1e-12)).astype(arr.dtype)
        return arr


__all__ = ["BaichuanTensors", "config_from_json", "norm_head"]
