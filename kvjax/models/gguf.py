"""Reading llama.cpp's GGUF files: the config and tokenizer from the file's metadata, the weights
dequantized one tensor at a time.

Only the `gguf` package (llama.cpp's own reader) touches the file: it memory-maps the data, and
`gguf.quants.dequantize` turns one tensor at a time into float32, which `kvjax.models.load` casts to the
requested dtype and drops before reading the next, so peak memory stays near one dequantized copy
of the model. No code from the file runs; the tokenizer is rebuilt from the metadata's vocabulary
by transformers' GGUF converter (never from files beside it), and saved once under
`$KVJAX_HOME/tokenizers/<digest of that metadata>` (converting a 49K-token vocabulary takes ~15 s).

llama.cpp's conventions that differ from Hugging Face's, undone here:

* tensor names (`blk.3.attn_q.weight` for `model.layers.3.self_attn.q_proj.weight`);
* the Q/K row order of "llama" files: llama.cpp's converter permutes q_proj / k_proj rows so that
  its interleaved-pair RoPE equals HF's rotate-half RoPE (`convert_hf_to_gguf.py`, `LlamaModel.permute`);
  Qwen2 / Qwen3 use the rotate-half RoPE in llama.cpp too ("NEOX"), so their rows are as in HF;
* no `output.weight`: the head is tied to the embeddings.

A "mistral" file is read like transformers reads one (rows as stored): llama.cpp writes Mistral
checkpoints as "llama" files, which get the llama treatment. A "gemma3" file (Gemma 3's text model) names its four
norms per layer its own way (`ffn_norm` is the one before the MLP) and stores every norm weight as 1 + w, which is
undone (as transformers' `Gemma2TensorProcessor` does); the rest of its config is transformers' Gemma 3 default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
from pathlib import Path

import numpy as np

from kvjax.errors import InvalidInput, MissingFile

log = logging.getLogger(__name__)

# Dequantized with llama.cpp's reference code (`gguf.quants`); anything else is refused by name.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


@dataclasses.dataclass(frozen=True)
class _Arch:
    hf_config: str  # the transformers config class its metadata becomes
    permuted_qk: bool  # llama.cpp permuted q/k rows for its interleaved RoPE
    layer_names: tuple = ()  # (GGUF name, HF name) of a layer's tensors where they differ from Llama's
    model_type: str | None = None  # transformers' model_type of its config, where it is not the architecture's name
    norm_shift: float = 0.0  # llama.cpp's converter added this to every norm weight (Gemma's `(1 + w)` stored)


# Gemma 3 (llama.cpp's `Gemma3Model`): four norms per layer, `ffn_norm` the one before the MLP, not after attention
_GEMMA3_LAYER = (("post_attention_norm", "post_attention_layernorm"), ("ffn_norm", "pre_feedforward_layernorm"),
                 ("post_ffw_norm", "post_feedforward_layernorm"))

ARCHITECTURES = {
    "llama": _Arch("LlamaConfig", True),
    "mistral": _Arch("MistralConfig", False),
    "qwen2": _Arch("Qwen2Config", False),
    "qwen3": _Arch("Qwen3Config", False),
    # the rest of its config (query_pre_attn_scalar, the local RoPE base, the 5:1 pattern of sliding layers) is not
    # in the file: transformers' Gemma3TextConfig defaults, as transformers reads the file
    "gemma3": _Arch("Gemma3TextConfig", False, _GEMMA3_LAYER, norm_shift=1.0, model_type="gemma3_text"),
}

_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf(path: Path) -> bool:
    """A file that starts with GGUF's magic bytes."""
    try:
        with Path(path).open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def hf_name(gguf_name: str, arch: _Arch = ARCHITECTURES["llama"]) -> str | None:
    """The HF tensor name of a GGUF tensor name in a file of `arch`, or None for one kvjax does not know."""
    stem, _, kind = gguf_name.rpartition(".")
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", stem):
        part = {**_LAYER, **dict(arch.layer_names)}.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{kind}"
    return f"{_GLOBAL[stem]}.{kind}" if stem in _GLOBAL else None


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's `permute(w, heads)`: within each head, its rows (i, i + d/2) pairs were
    interleaved as (2i, 2i + 1); put them back in halves."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """One GGUF file: its metadata, its architecture, and its tensors by HF name (what `kvjax.models.load`
    reads through `names / shape / get`, like a directory's safetensors)."""

    def __init__(self, path: Path):
        import gguf

        from kvjax.models.fetch import check_fetched, refetch_hint

        self.path = Path(path)
        if not self.path.is_file():
            raise MissingFile(f"GGUF file {str(self.path)!r} does not exist")
        check_fetched(self.path)  # a fetched model's file against its pinned SHA-256, on every load
        try:
            self.reader = gguf.GGUFReader(str(self.path), "r")
        except (ValueError, OSError, IndexError, KeyError) as err:  # truncated or corrupt header
            raise InvalidInput(f"{self.path} is not a readable GGUF file ({type(err).__name__}: {err})"
                               f"{refetch_hint(self.path)}") from None
        self.files = [self.path]
        self.arch_name = self.text("general.architecture")
        if self.arch_name not in ARCHITECTURES:
            raise InvalidInput(f"{self.path}: GGUF architecture {self.arch_name!r} is not supported; kvjax reads "
                               f"{sorted(ARCHITECTURES)}")
        self.arch = ARCHITECTURES[self.arch_name]
        self._tensors = {}
        unknown = []
        for t in self.reader.tensors:
            name = hf_name(t.name, self.arch)
            if name is None:
                unknown.append(t.name)
                continue
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise InvalidInput(f"{self.path}: tensor {t.name!r} is stored as {t.tensor_type.name}, which kvjax "
                                   f"does not dequantize; supported: {', '.join(SUPPORTED_TYPES)}")
            self._tensors[name] = t
        if unknown:
            hint = (" (rope_freqs: Llama 3's RoPE scaling as a frequency table, which kvjax does not read; "
                    "load the HF checkpoint instead)" if "rope_freqs.weight" in unknown else "")
            raise InvalidInput(f"{self.path}: tensors kvjax does not know: {unknown[:6]}"
                               f"{' ...' if len(unknown) > 6 else ''}{hint}")

    # ---- metadata ----

    @property
    def hf_model_type(self) -> str:
        """The transformers model_type its config is read as (`kvjax.models.loading.ARCHITECTURES`' key)."""
        return self.arch.model_type or self.arch_name

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def text(self, key: str) -> str:
        value = self.field(key)
        if not isinstance(value, str):
            raise InvalidInput(f"{self.path}: GGUF metadata {key!r} is missing or not a string")
        return value

    def hp(self, key: str, default=None):
        """`{architecture}.{key}` from the metadata: a hyperparameter."""
        return self.field(f"{self.arch_name}.{key}", default)

    def hf_config(self):
        """The transformers config its metadata describes (read by the family's `from_hf`, as a
        directory's config.json is)."""
        import transformers

        need, size = self._need, self._size
        heads = size("attention.head_count")
        hidden = size("embedding_length")
        head_dim = self._size("attention.key_length", hidden // heads)
        kv_heads = self._size("attention.head_count_kv", heads)
        if heads % kv_heads:
            raise InvalidInput(f"{self.path}: GGUF metadata {self.arch_name}.attention.head_count={heads} is not a "
                               f"multiple of attention.head_count_kv={kv_heads}")
        if self.arch.permuted_qk and head_dim % 2:
            # llama.cpp's permutation pairs rows (i, i + d/2) within a head: an odd head size cannot be undone
            raise InvalidInput(f"{self.path}: head size {head_dim} (GGUF metadata {self.arch_name}.attention."
                               f"key_length, or embedding_length / head_count) is odd; a {self.arch_name} file's "
                               "RoPE rows come in pairs, so its head size is even")
        rot = self.hp("rope.dimension_count")
        if rot is not None and int(rot) != head_dim:
            raise InvalidInput(f"{self.path}: partial RoPE ({rot} of {head_dim} dimensions) is not supported")
        rope = {"rope_type": "default", "rope_theta": float(self.hp("rope.freq_base", 10000.0))}
        scaling = self.hp("rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise InvalidInput(f"{self.path}: RoPE scaling {scaling!r} is not supported in GGUF files "
                                   "(kvjax reads 'linear'); load the HF checkpoint instead")
            rope = {**rope, "rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
        vocab = self.hp("vocab_size")
        if vocab is None:
            tokens = self.field("tokenizer.ggml.tokens")
            vocab = len(tokens) if tokens is not None else self._tensors["model.embed_tokens.weight"].shape[1]
        kw = dict(
            vocab_size=int(vocab), hidden_size=hidden, intermediate_size=size("feed_forward_length"),
            num_hidden_layers=size("block_count"), num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=size("context_length"),
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")), rope_parameters=rope,
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.field("tokenizer.ggml.eos_token_id"),
            pad_token_id=self.field("tokenizer.ggml.padding_token_id"),
        )
        if self.arch_name == "llama":
            kw["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in self._tensors
        if self.arch_name in ("mistral", "gemma3"):
            kw["sliding_window"] = self.hp("attention.sliding_window")
        if self.arch_name == "gemma3":  # its config takes the global RoPE base by name (the local one: its default)
            if rope["rope_type"] != "default":
                raise InvalidInput(f"{self.path}: RoPE scaling in a gemma3 GGUF file is not supported")
            kw.pop("rope_parameters")
            kw["rope_theta"] = rope["rope_theta"]
        return getattr(transformers, self.arch.hf_config)(**kw)

    def _need(self, key: str):
        value = self.hp(key)
        if value is None:
            raise InvalidInput(f"{self.path}: GGUF metadata {self.arch_name}.{key} is missing")
        return value

    def _size(self, key: str, default=None) -> int:
        """A count or a size from the metadata (heads, layers, widths): a positive integer, or one line
        naming the key (a 0 head count once divided by zero; a float or a list, a reshape error later)."""
        value = self._need(key) if default is None else self.hp(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise InvalidInput(f"{self.path}: GGUF metadata {self.arch_name}.{key}={value!r} is not a positive integer")
        return int(value)

    # ---- tensors, as `kvjax.models.loading` reads them ----

    def names(self) -> set[str]:
        return set(self._tensors)

    def source(self, name: str) -> str:
        return self._tensors[name].name if name in self._tensors else name

    def file(self, name: str) -> Path:
        return self.path

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensors[name].shape))  # GGUF lists the fastest axis first

    def get(self, name: str) -> np.ndarray:
        """One tensor dequantized to float32 in HF layout (q/k rows un-permuted)."""
        from gguf.quants import dequantize

        t = self._tensors[name]
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(self.shape(name))
        if self.arch.permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                                     "k_proj.bias")):
            heads = self._need("attention.head_count")
            if ".k_proj." in name:
                heads = self.hp("attention.head_count_kv", heads)
            w = unpermute(w, int(heads))
        if self.arch.norm_shift and name.endswith("norm.weight"):
            w = w - np.float32(self.arch.norm_shift)  # as transformers' Gemma2TensorProcessor undoes it
        return w

    # ---- tokenizer ----

    def tokenizer(self):
        """A transformers tokenizer rebuilt from the metadata (None if the file has none), converted
        once and kept under `$KVJAX_HOME/tokenizers/<hash of the tokenizer metadata>`.

        transformers' GGUF converter builds the vocabulary, merges and pre-tokenizer; its wrapper
        class is not used, since in transformers 5.2 it names the wrong EOS for GPT-2-style
        vocabularies (`<|im_start|>` for SmolLM2, whose file says id 2, `<|im_end|>`) and adds BOS
        whatever the file says. The special tokens come from the file's ids, BOS / EOS are added as
        `tokenizer.ggml.add_bos_token` / `add_eos_token` say (llama.cpp's default when absent: BOS
        for SentencePiece vocabularies only), and the chat template is the file's."""
        if self.field("tokenizer.ggml.model") is None:
            return None
        from transformers import PreTrainedTokenizerFast

        from kvjax.models.fetch import home_dir

        cache = home_dir("tokenizers") / self.tokenizer_digest()
        if not (cache / "tokenizer.json").is_file():
            log.info("converting the tokenizer of %s (once; kept in %s)", self.path.name, cache)
            tok = self._convert_tokenizer()
            tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
            try:
                tok.save_pretrained(tmp)
            except OSError as err:
                from kvjax.models.fetch import home_error

                raise home_error(err) from None
            try:
                tmp.replace(cache)
            except OSError:  # another process saved it first
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
        return PreTrainedTokenizerFast.from_pretrained(cache, local_files_only=True)

    def _convert_tokenizer(self):
        from tokenizers.processors import TemplateProcessing
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.ggml import convert_gguf_tokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        # transformers' converter is called on the file's own metadata, not through
        # `AutoTokenizer.from_pretrained(folder, gguf_file=...)`: that prefers any tokenizer.json in the
        # folder, so a neighbouring model's tokenizer was used (and cached as this file's).
        try:
            vocab = load_gguf_checkpoint(str(self.path), return_tensors=False)["tokenizer"]
            backend, _ = convert_gguf_tokenizer(_TOKENIZER_CONVERTER.get(self.arch_name, self.arch_name), vocab)
        except Exception as err:  # transformers' converter raises bare Exceptions on odd vocabularies
            raise InvalidInput(f"{self.path}: the tokenizer in its metadata cannot be converted "
                               f"({type(err).__name__}: {err})") from err
        tokens = self.field("tokenizer.ggml.tokens")
        special = {}
        for key, attr in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"),
                          ("padding", "pad_token")):
            i = self.field(f"tokenizer.ggml.{key}_token_id")
            if i is not None and 0 <= int(i) < len(tokens):
                special[attr] = tokens[int(i)]
        spm = self.field("tokenizer.ggml.model") == "llama"
        add_bos = bool(self.field("tokenizer.ggml.add_bos_token", spm)) and "bos_token" in special
        add_eos = bool(self.field("tokenizer.ggml.add_eos_token", False)) and "eos_token" in special
        single = ([special["bos_token"]] if add_bos else []) + ["$A"] + ([special["eos_token"]] if add_eos else [])
        pair = single + [t if t != "$A" else "$B" for t in single]
        used = {special[k] for k, on in (("bos_token", add_bos), ("eos_token", add_eos)) if on}
        backend.post_processor = TemplateProcessing(
            single=single, pair=pair, special_tokens=[(t, tokens.index(t)) for t in sorted(used)])
        template = self.field("tokenizer.chat_template")
        return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, **special)

    def tokenizer_digest(self) -> str:
        """The cache key of the converted tokenizer: a function of everything the conversion reads and
        nothing else (the tokenizer metadata, the architecture that picks transformers' converter, and
        the version of this conversion), in full, so two different vocabularies never share an entry."""
        h = hashlib.sha256()
        for part in (f"kvjax-gguf-tokenizer/{_TOKENIZER_FORMAT}", self.arch_name):
            h.update(len(part).to_bytes(8, "little") + part.encode())
        for key in sorted(k for k in self.reader.fields if k.startswith("tokenizer.")):
            for part in (key, repr(self.field(key))):  # length-prefixed: no two key/value lists hash alike
                h.update(len(part).to_bytes(8, "little") + part.encode())
        return h.hexdigest()


# Bumped when the conversion changes, so tokenizers converted before are not served again (format 1
# read the folder's tokenizer.json when there was one).
_TOKENIZER_FORMAT = 2
# transformers has no GGUF tokenizer converter for "mistral" (KeyError); Mistral's vocabulary is Llama's
# SentencePiece one, which llama's converter reads (it branches on tokenizer.ggml.model, not the architecture).
# Gemma 3's is registered under its text model's name.
_TOKENIZER_CONVERTER = {"mistral": "llama", "gemma3": "gemma3_text"}
