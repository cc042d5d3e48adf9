"""DuoAttention (Xiao et al. 2024, arXiv:2410.10819): retrieval heads keep the whole cache, streaming heads
keep `sinks` attention sinks and the `recent` latest tokens (StreamingLLM), each kind in its own arrays
(`kvjax.cache.HeadwiseCache`), so the streaming heads' memory really shrinks (kvpress's `DuoAttentionPress`
masks the evicted keys instead, which, as its attention patch says, "does not reduce peak memory").

The head pattern is a score per (layer, KV head), higher for a head that needs the whole context:

* DuoAttention's own optimised gates, as its repository ships them (`attn_patterns/<model>/`:
  `full_attention_heads.tsv` and `config.json` with `sink_size` / `recent_size`), read by
  `load_pattern(dir)`;
* kvpress's "on the fly" scores (`kvjax.heads.duo_scores`): the mean query and key of each head over some
  text, repeated with RoPE, and the area under the cumulated attention curve of the last query;
* any table of your own.

`head_compression` is the share of KV heads turned into streaming heads: the lowest-scored, as kvpress
chooses them (`round(n_heads * head_compression)` of them over all layers).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from kvjax.errors import InvalidInput, MissingFile
from kvjax import values
from kvjax.policies.base import LayerPolicy, PrefillMode, check_numbers, recent_option, sinks_option
from kvjax.policies.options import Option, given, register
from kvjax.policies.compose import ByHead
from kvjax.policies.ring import FullCache, StreamingLLM


@dataclasses.dataclass(frozen=True, kw_only=True)
class DuoAttention(ByHead):
    """`streaming[layer][kv_head]`: True for a streaming head (sinks + recent window), False for a retrieval
    head (the whole cache)."""

    streaming: tuple[tuple[bool, ...], ...]
    sinks: int = sinks_option(128)
    recent: int = recent_option(256)
    prefill_mode: PrefillMode = "full"
    chunk: int | None = None

    def __post_init__(self):
        check_numbers(self)
        rows = self.streaming
        if not rows or len({len(r) for r in rows}) != 1 or not rows[0]:
            raise InvalidInput("DuoAttention: the head table must have the same non-zero number of KV heads per layer")
        if self.sinks < 0 or self.recent < 1:
            raise InvalidInput(f"DuoAttention: sinks={self.sinks} must be >= 0 and recent={self.recent} >= 1")
        StreamingLLM(budget=self.sinks + self.recent, sinks=self.sinks, prefill_mode=self.prefill_mode, chunk=self.chunk)

    def _num_layers(self):
        return len(self.streaming)

    def check(self, num_layers, num_kv_heads=None):
        if num_layers != len(self.streaming) or (num_kv_heads is not None and num_kv_heads != len(self.streaming[0])):
            raise InvalidInput(f"DuoAttention: the head table is {len(self.streaming)} layers x "
                               f"{len(self.streaming[0])} KV heads, the model has {num_layers} x {num_kv_heads}")
        super().check(num_layers, num_kv_heads)

    def head_split(self, layer):
        modes = dict(prefill_mode=self.prefill_mode, chunk=self.chunk)
        heads = range(len(self.streaming[layer]))
        full = tuple(h for h in heads if not self.streaming[layer][h])
        stream = tuple(h for h in heads if self.streaming[layer][h])
        split = [(full, FullCache(**modes))] if full else []
        if stream:
            split.append((stream, StreamingLLM(budget=self.sinks + self.recent, sinks=self.sinks, **modes)))
        return tuple(split)

    def describe(self):
        n = sum(map(sum, self.streaming))
        total = len(self.streaming) * len(self.streaming[0])
        digest = hashlib.sha1(repr(self.streaming).encode()).hexdigest()[:8]  # which heads, not only how many
        return (f"DuoAttention(streaming {digest}: {n}/{total} KV heads, sinks={self.sinks}, recent={self.recent}"
                + ("" if self.prefill_mode == "full" else f", prefill_mode={self.prefill_mode!r}")
                + ("" if self.chunk is None else f", chunk={self.chunk}") + ")")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DuoAttentionOnce(DuoAttention):
    """DuoAttention as kvpress runs it (`DuoAttentionPress`): a streaming head keeps the sinks and the latest
    `recent` tokens of the prompt, chosen once, and then every question and answer token is appended
    (`kvjax.policies.scored.PromptStreamingLLM`). `DuoAttention`'s streaming heads slide instead, a constant
    sinks + recent cache while decoding, as the paper runs them; the two hold the same slots at the prompt's end
    and differ from its first new token on."""

    def __post_init__(self):
        super().__post_init__()
        if self.prefill_mode != "full":
            raise InvalidInput(f"DuoAttentionOnce: prefill_mode={self.prefill_mode!r}; a press compresses a whole "
                               "prompt once, so only 'full' runs it")

    def head_split(self, layer):
        from kvjax.policies.scored import PromptStreamingLLM

        return tuple((heads, PromptStreamingLLM(budget=self.sinks + self.recent, sinks=self.sinks)
                      if isinstance(rule, StreamingLLM) else rule) for heads, rule in super().head_split(layer))

    def describe(self):
        return "DuoAttentionOnce" + super().describe().removeprefix("DuoAttention")


def streaming_heads(scores, head_compression: float) -> tuple[tuple[bool, ...], ...]:
    """The `round(size * head_compression)` lowest-scored heads of a `[layers, kv_heads]` score table (kvpress's
    choice: a stable argsort over the flattened table)."""
    scores = np.asarray(scores, np.float64)
    if scores.ndim != 2:
        raise InvalidInput(f"DuoAttention: head scores must be a [layers, kv_heads] table, got shape {scores.shape}")
    if not np.all(np.isfinite(scores)):
        raise InvalidInput("DuoAttention: head scores hold NaN or inf")
    if not 0 <= head_compression <= 1:
        raise InvalidInput(f"DuoAttention: head_compression={head_compression} must be in [0, 1]")
    mask = np.zeros(scores.size, bool)
    n = round(scores.size * head_compression)
    if n:
        mask[np.argsort(scores, axis=None, kind="stable")[:n]] = True
    return tuple(tuple(bool(x) for x in row) for row in mask.reshape(scores.shape))


def load_pattern(path) -> tuple[np.ndarray, int, int]:
    """(head scores `[layers, kv_heads]` clipped to [0, 1], sink size, recent size) from a DuoAttention pattern
    directory (`full_attention_heads.tsv`, `config.json`), or a kvjax heads file with `duo_scores`. A file that is
    not what it should be (not JSON, a ragged table, a size missing or not a whole number) is one error naming it."""
    path = Path(path)
    if path.is_file():
        data = _json_object(path)
        if "duo_scores" not in data:
            raise InvalidInput(f"{path} has no 'duo_scores' table (write one with python -m kvjax.experiments.find_heads "
                               "--duo)")
        return (_score_table(data["duo_scores"], f"{path}: duo_scores"), _size(data, "sink_size", path, 128),
                _size(data, "recent_size", path, 256))
    tsv, cfg = path / "full_attention_heads.tsv", path / "config.json"
    for f in (tsv, cfg):
        if not f.is_file():
            raise MissingFile(f"{f} not found: a DuoAttention pattern directory holds full_attention_heads.tsv and "
                              "config.json (the attn_patterns folders of mit-han-lab/duo-attention)")
    try:
        scores = np.loadtxt(tsv, dtype=float, delimiter="\t", ndmin=2)
    except (ValueError, UnicodeDecodeError) as err:
        raise InvalidInput(f"{tsv}: unreadable DuoAttention head table ({err})") from None
    meta = _json_object(cfg)
    return np.clip(scores, 0, 1), _size(meta, "sink_size", cfg), _size(meta, "recent_size", cfg)


def _json_object(path: Path) -> dict:
    """The JSON object in `path`, or `InvalidInput` naming the file (not UTF-8, not JSON, not an object)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise InvalidInput(f"{path} is not a JSON file ({err})") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def _score_table(values, where: str) -> np.ndarray:
    """A `[layers, kv_heads]` table of numbers, or `InvalidInput` naming `where` (ragged rows, text)."""
    try:
        return np.asarray(values, np.float64)
    except (ValueError, TypeError):
        raise InvalidInput(f"{where} is not a [layers, kv_heads] table of numbers (rows of different lengths, or "
                           "values that are not numbers)") from None


def _size(meta: dict, key: str, path: Path, default: int | None = None) -> int:
    """`meta[key]`, a whole number of tokens (>= 0), or its `default`; else `InvalidInput` naming the file and key
    (`int()` would turn 1.5 into 1 and refuse "128" with a traceback)."""
    if key not in meta:
        if default is None:
            raise InvalidInput(f"{path} has no {key!r} (a whole number of tokens)")
        return default
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer() or value < 0:
        raise InvalidInput(f"{path}: {key}={value!r} must be a whole number of tokens >= 0")
    return int(value)


def duo_from_pattern(path, head_compression: float = 0.5, *, sinks: int | None = None, recent: int | None = None,
                     prefill_mode: PrefillMode = "full", chunk: int | None = None, kind: type = DuoAttention
                     ) -> DuoAttention:
    """DuoAttention (`kind`: or `DuoAttentionOnce`) from a pattern (`load_pattern`); `sinks` / `recent` override the
    pattern's sizes."""
    scores, sink_size, recent_size = load_pattern(path)
    return kind(streaming=streaming_heads(scores, head_compression),
                        sinks=sink_size if sinks is None else sinks, recent=recent_size if recent is None else recent,
                        prefill_mode=prefill_mode, chunk=chunk)


# ---- registration ------------------------------------------------------------------------------------------------

DUO_OPTIONS = {
    "duo_pattern": Option(help="DuoAttention: a pattern folder (full_attention_heads.tsv + config.json, as "
                               "mit-han-lab/duo-attention ships them) or a heads file with duo_scores (python -m "
                               "kvjax.experiments.find_heads --duo)"),
    "head_compression": Option(type=values.fraction_removed,
                               help="DuoAttention: the share of KV heads made streaming heads (the lowest-scored)"),
}


def _pattern(path, name: str):
    if path is None:
        raise InvalidInput(f"--policy {name} needs --duo-pattern")
    return path


def _duo(budget, duo_pattern=None, head_compression=0.5, sinks=None, recent=None, prefill_mode=None,
         chunk=None) -> DuoAttention:
    # a pattern (DuoAttention's attn_patterns folder, or a heads file with duo_scores from `kvjax.experiments.find_heads
    # --duo`); --head-compression: the share of KV heads made streaming heads
    return duo_from_pattern(_pattern(duo_pattern, "duo"), head_compression, sinks=sinks, recent=recent,
                            **given(prefill_mode=prefill_mode, chunk=chunk))


def _duo_kvpress(budget, duo_pattern=None, head_compression=0.5, sinks=None, recent=None) -> DuoAttention:
    # as kvpress's DuoAttentionPress runs it: the streaming heads' sinks and window chosen once from the prompt, then
    # every new token appended (`duo` slides them, as the paper does)
    return duo_from_pattern(_pattern(duo_pattern, "duo-kvpress"), head_compression, sinks=sinks, recent=recent,
                            kind=DuoAttentionOnce)


PATTERNS = {"sinks": "the pattern's", "recent": "the pattern's"}  # not given: the pattern's sizes
register("duo", build=_duo, classes=(DuoAttention, LayerPolicy), options=DUO_OPTIONS, budget=False,
         paper="Xiao et al. 2025", docs="policies/duo.md", chunked="exact", memory="real, head-wise arrays",
         defaults=PATTERNS)
register("duo-kvpress", build=_duo_kvpress, classes=(DuoAttention,), options=DUO_OPTIONS, budget=False,
         defaults=PATTERNS, paper="kvpress's DuoAttentionPress (streaming heads from the prompt, then appended)", docs="policies/duo.md",
         chunked="refused", kvpress="`DuoAttentionPress`", memory="real, head-wise arrays")
