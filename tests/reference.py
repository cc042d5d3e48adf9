"""An independent NumPy Llama that keeps, per layer, an explicit list of cached tokens.

It shares no code with kvjax: weights are read straight from model.safetensors,
RoPE is written out again, and what the cache keeps is decided by a plain-Python
`update(layer, entries, new) -> entries` rule. Each entry is a dict with the
token's `pos`, unrotated key `k` [kvh, d], value `v` [kvh, d] and `pi` [kvh]
(its logit to the first token, aggregated over the query heads of each KV head).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


class RefLlama:
    def __init__(self, path: Path, agg: str = "mean"):
        cfg = json.loads((Path(path) / "config.json").read_text())
        self.w = {k: v.astype(np.float64) for k, v in load_file(str(Path(path) / "model.safetensors")).items()}
        self.L = cfg["num_hidden_layers"]
        self.h = cfg["num_attention_heads"]
        self.kvh = cfg["num_key_value_heads"]
        self.g = self.h // self.kvh
        self.d = cfg.get("head_dim") or cfg["hidden_size"] // self.h
        self.eps = cfg["rms_norm_eps"]
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        assert rope.get("rope_type", "default") == "default", "reference supports plain RoPE only"
        self.freq = 1.0 / theta ** (np.arange(0, self.d, 2) / self.d)
        self.tied = "lm_head.weight" not in self.w
        self.agg = {"mean": np.mean, "max": np.max}[agg]

    def _norm(self, x, name):
        return self.w[name] * x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps)

    def rope(self, x, pos):  # x [..., d], pos broadcastable to x[..., 0]
        a = np.asarray(pos, np.float64)[..., None] * self.freq
        x1, x2 = x[..., : self.d // 2], x[..., self.d // 2 :]
        return np.concatenate([x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)], -1)

    def _proj(self, x, name):
        return x @ self.w[name].T

    def _qkv(self, hx, i):
        p = f"model.layers.{i}.self_attn."
        lead = hx.shape[:-1]
        q = self._proj(hx, p + "q_proj.weight").reshape(*lead, self.h, self.d)
        k = self._proj(hx, p + "k_proj.weight").reshape(*lead, self.kvh, self.d)
        v = self._proj(hx, p + "v_proj.weight").reshape(*lead, self.kvh, self.d)
        return q, k, v

    def _mlp(self, x, i):
        p = f"model.layers.{i}.mlp."
        g = self._proj(x, p + "gate_proj.weight")
        return self._proj(g / (1 + np.exp(-g)) * self._proj(x, p + "up_proj.weight"), p + "down_proj.weight")

    def _finish(self, x, out, i):
        p = f"model.layers.{i}."
        x = x + self._proj(out, p + "self_attn.o_proj.weight")
        return x + self._mlp(self._norm(x, p + "post_attention_layernorm.weight"), i)

    def _logits(self, x):
        x = self._norm(x, "model.norm.weight")
        return x @ (self.w["model.embed_tokens.weight"] if self.tied else self.w["lm_head.weight"]).T

    def _attend_head(self, qh_list, entries, rolling, new_pos):
        """Attention of query heads `qh_list` ([g, d], unrotated) over one KV head's entries."""
        positions = np.arange(len(entries)) if rolling else np.array([e["pos"] for e in entries])
        q_pos = positions[[e["pos"] for e in entries].index(new_pos)]
        # An entry may carry an already-rotated key (a RazorAttention compensation token is a
        # mean of rotated keys, eq. 4) and a logit bias `log_w` (its log N_d, eq. 5).
        ks = np.stack([e["k_rot"] if "k_rot" in e else self.rope(e["k"], pp) for e, pp in zip(entries, positions)])
        bias = np.array([e.get("log_w", 0.0) for e in entries])
        vs = np.stack([e["v"] for e in entries])
        first = [e["pos"] for e in entries].index(0) if any(e["pos"] == 0 for e in entries) else None
        outs, logit0 = [], []
        for qh in qh_list:
            qr = self.rope(qh, q_pos)
            s = ks @ qr / np.sqrt(self.d) + bias
            pr = np.exp(s - s.max())
            pr = pr / pr.sum()
            outs.append(pr @ vs)
            logit0.append(s[first] if first is not None else np.nan)
            for e, w in zip(entries, pr):  # accumulated attention (H2O's score), over the group
                e["acc"] = e.get("acc", 0.0) + w
        return np.stack(outs), self.agg(np.array(logit0))

    def step(self, token, pos, caches, update, rolling):
        """One token through every layer: per KV head, insert/evict by `update`, then attend.

        `caches[layer][head]` is a list of entries; attention uses absolute positions,
        or ranks in the head's cache when `rolling`.
        """
        x = self.w["model.embed_tokens.weight"][token]
        for i in range(self.L):
            q, k, v = self._qkv(self._norm(x, f"model.layers.{i}.input_layernorm.weight"), i)
            out = np.zeros((self.h, self.d))
            for j in range(self.kvh):
                new = {"pos": pos, "k": k[j], "v": v[j], "pi": None}
                head = {"head": j} if getattr(update, "per_head", False) else {}  # head-wise rules
                entries = sorted(update(i, list(caches[i][j]), new, **head), key=lambda e: e["pos"])
                caches[i][j] = entries
                out[j * self.g : (j + 1) * self.g], new["pi"] = self._attend_head(
                    q[j * self.g : (j + 1) * self.g], entries, rolling, pos
                )
            x = self._finish(x, out.reshape(-1), i)
        return self._logits(x)

    def prefill(self, tokens, caches, update):
        """Full causal attention over the prompt at true positions; each head's cache is then
        built by feeding the prompt's entries to `update` one at a time. Returns the last logits."""
        n = len(tokens)
        x = self.w["model.embed_tokens.weight"][np.asarray(tokens)]
        pos = np.arange(n)
        mask = np.tril(np.ones((n, n), bool))
        for i in range(self.L):
            q, k, v = self._qkv(self._norm(x, f"model.layers.{i}.input_layernorm.weight"), i)
            qr, kr = self.rope(q, pos[:, None]), self.rope(k, pos[:, None])
            out = np.zeros((n, self.h, self.d))
            for hh in range(self.h):
                s = qr[:, hh] @ kr[:, hh // self.g].T / np.sqrt(self.d)
                s = np.where(mask, s, -np.inf)
                pr = np.exp(s - s.max(-1, keepdims=True))
                out[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ v[:, hh // self.g]
            for j in range(self.kvh):
                logit0 = qr[:, j * self.g : (j + 1) * self.g] @ kr[0, j] / np.sqrt(self.d)  # [n, g]
                entries = []
                for t in range(n):
                    new = {"pos": t, "k": k[t, j], "v": v[t, j], "pi": self.agg(logit0[t])}
                    entries = sorted(update(i, entries, new), key=lambda e: e["pos"])
                caches[i][j] = entries
            x = self._finish(x, out.reshape(n, -1), i)
        return self._logits(x[-1])

    def empty_caches(self):
        return [[[] for _ in range(self.kvh)] for _ in range(self.L)]


def streaming_keep(sinks: int, budget: int):
    """StreamingLLM's rule on positions: the first `sinks` + the newest `budget - sinks`."""

    def keep(positions: list[int]) -> list[int]:
        ps = sorted(positions)
        if len(ps) <= budget:
            return ps
        return ps[:sinks] + ps[len(ps) - (budget - sinks) :]

    return keep


def streaming_update(sinks: int, budget: int):
    keep = streaming_keep(sinks, budget)

    def update(layer, entries, new):
        entries = entries + [new]
        kept = set(keep([e["pos"] for e in entries]))
        return [e for e in entries if e["pos"] in kept]

    return update


def mat_update(budget: int, anchors: int, shallow_layers: int, sinks: int):
    """Algorithm 1, one token at a time, on one KV head's list ordered by position."""

    def update(layer, entries, new):
        if len(entries) < budget:  # not full: append
            return entries + [new]
        if layer < shallow_layers:  # eq. 5: drop the oldest non-sink
            return entries[:sinks] + entries[sinks + 1 :] + [new]
        window_start = new["pos"] - (budget - anchors) + 1  # eq. 4: the window after inserting `new`
        cands = [e for e in entries if e["pos"] != 0 and e["pos"] < window_start]
        worst = max(cands, key=lambda e: (e["pi"], -e["pos"]))  # highest pi; ties: the oldest
        return [e for e in entries if e is not worst] + [new]

    return update


def h2o_update(budget: int, recent: int):
    """H2O while decoding: when full, evict the lowest accumulated attention outside the recent window."""

    def update(layer, entries, new):
        new["acc"] = 0.0
        if len(entries) < budget:
            return entries + [new]
        cands = [e for e in entries if e["pos"] <= new["pos"] - recent]
        lightest = min(cands, key=lambda e: (e["acc"], e["pos"]))  # ties: the oldest
        return [e for e in entries if e is not lightest] + [new]

    return update
