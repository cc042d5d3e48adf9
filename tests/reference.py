"""An independent NumPy Llama that keeps, per layer, an explicit list of cached tokens.

It shares no code with kvjax: weights are read straight from model.safetensors,
RoPE is written out again, and eviction is whatever the test's Python function
says. Used to check kvjax's cache policies step by step.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


class RefLlama:
    def __init__(self, path: Path):
        cfg = json.loads((Path(path) / "config.json").read_text())
        self.w = {k: v.astype(np.float64) for k, v in load_file(str(Path(path) / "model.safetensors")).items()}
        self.L = cfg["num_hidden_layers"]
        self.h = cfg["num_attention_heads"]
        self.kvh = cfg["num_key_value_heads"]
        self.d = cfg.get("head_dim") or cfg["hidden_size"] // self.h
        self.eps = cfg["rms_norm_eps"]
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        assert rope.get("rope_type", "default") == "default", "reference supports plain RoPE only"
        self.freq = 1.0 / theta ** (np.arange(0, self.d, 2) / self.d)
        self.tied = "lm_head.weight" not in self.w

    def _norm(self, x, name):
        return self.w[name] * x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps)

    def rope(self, x, pos):  # x [..., d], pos broadcastable to x[..., 0]
        a = np.asarray(pos, np.float64)[..., None] * self.freq
        x1, x2 = x[..., : self.d // 2], x[..., self.d // 2 :]
        return np.concatenate([x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)], -1)

    def _proj(self, x, name):
        return x @ self.w[name].T

    def _mlp(self, x, i):
        p = f"model.layers.{i}.mlp."
        g = self._proj(x, p + "gate_proj.weight")
        return self._proj(g / (1 + np.exp(-g)) * self._proj(x, p + "up_proj.weight"), p + "down_proj.weight")

    def _logits(self, x):
        x = self._norm(x, "model.norm.weight")
        return x @ (self.w["model.embed_tokens.weight"] if self.tied else self.w["lm_head.weight"]).T

    def step(self, token, pos, caches, evict, rolling):
        """Appends one token; `caches[l]` is a list of (pos, k_unrotated [kvh, d], v [kvh, d]).

        `evict(list_of_positions)` returns the positions to keep. Attention
        uses absolute positions, or ranks in the cache when `rolling`.
        """
        x = self.w["model.embed_tokens.weight"][token]
        g = self.h // self.kvh
        for i in range(self.L):
            p = f"model.layers.{i}."
            hx = self._norm(x, p + "input_layernorm.weight")
            q = self._proj(hx, p + "self_attn.q_proj.weight").reshape(self.h, self.d)
            k = self._proj(hx, p + "self_attn.k_proj.weight").reshape(self.kvh, self.d)
            v = self._proj(hx, p + "self_attn.v_proj.weight").reshape(self.kvh, self.d)
            entries = caches[i] + [(pos, k, v)]
            keep = set(evict([e[0] for e in entries]))
            entries = sorted((e for e in entries if e[0] in keep), key=lambda e: e[0])
            caches[i] = entries
            positions = np.arange(len(entries)) if rolling else np.array([e[0] for e in entries])
            q_pos = positions[-1]
            ks = np.stack([self.rope(e[1], pp) for e, pp in zip(entries, positions)], 1)  # [kvh, n, d]
            vs = np.stack([e[2] for e in entries], 1)
            out = np.zeros((self.h, self.d))
            for hh in range(self.h):
                qh = self.rope(q[hh], q_pos)
                s = ks[hh // g] @ qh / np.sqrt(self.d)
                pr = np.exp(s - s.max())
                out[hh] = (pr / pr.sum()) @ vs[hh // g]
            x = x + self._proj(out.reshape(-1), p + "self_attn.o_proj.weight")
            x = x + self._mlp(self._norm(x, p + "post_attention_layernorm.weight"), i)
        return self._logits(x)

    def prefill(self, tokens, caches, evict):
        """Full causal attention over the prompt at true positions, then `evict` once.

        Returns the last position's logits; caches hold unrotated keys.
        """
        n = len(tokens)
        x = self.w["model.embed_tokens.weight"][np.asarray(tokens)]
        pos = np.arange(n)
        g = self.h // self.kvh
        mask = np.tril(np.ones((n, n), bool))
        for i in range(self.L):
            p = f"model.layers.{i}."
            hx = self._norm(x, p + "input_layernorm.weight")
            q = self._proj(hx, p + "self_attn.q_proj.weight").reshape(n, self.h, self.d)
            k = self._proj(hx, p + "self_attn.k_proj.weight").reshape(n, self.kvh, self.d)
            v = self._proj(hx, p + "self_attn.v_proj.weight").reshape(n, self.kvh, self.d)
            qr, kr = self.rope(q, pos[:, None]), self.rope(k, pos[:, None])
            out = np.zeros((n, self.h, self.d))
            for hh in range(self.h):
                s = qr[:, hh] @ kr[:, hh // g].T / np.sqrt(self.d)
                s = np.where(mask, s, -np.inf)
                pr = np.exp(s - s.max(-1, keepdims=True))
                out[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ v[:, hh // g]
            x = x + self._proj(out.reshape(n, -1), p + "self_attn.o_proj.weight")
            x = x + self._mlp(self._norm(x, p + "post_attention_layernorm.weight"), i)
            keep = set(evict(list(range(n))))
            caches[i] = [(j, k[j], v[j]) for j in range(n) if j in keep]
        return self._logits(x[-1])


def streaming_keep(sinks: int, budget: int):
    """StreamingLLM's rule, written the plain way: the first `sinks` + the newest the rest."""

    def keep(positions: list[int]) -> list[int]:
        ps = sorted(positions)
        if len(ps) <= budget:
            return ps
        return ps[:sinks] + ps[len(ps) - (budget - sinks) :]

    return keep
