"""No silent wrong results, round 4 (issue #61), the library's and the benchmarks' part: the quantized cache's
bytes, the width in every label, the policies' numeric options, the layer API's plan sizes, sampling at any
temperature, the results directory's own record, and one-line errors from every entry point.

Test names carry `reliability`, `identity`, `nonfinite`, `cli_error`, `atomic` or `lock`
(`pytest -k "reliability or identity or nonfinite or cli_error or atomic or lock"`).
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kvcache
from kvjax import layer, quant
from kvjax.errors import InvalidInput
from kvjax.policies import FullCache, Quantized, StreamingLLM, resolve
from kvjax.quant import KVQuant


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("\r", "usage:", " "))]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    return lines[0]


# ---- item 3: a quantized cache is never larger than the unquantized one -----------------------------------


def test_reliability_quantized_residual_never_outgrows_the_cache():
    """`--kv-bits 2 --kv-residual 1000 --budget 32` allocated 1000 full-precision slots beside 32 slots of codes.
    By hand, for 32 slots of head size 16 in float32 at 2 bits, G = 8: unquantized 2*32*16*4 = 4096 bytes per KV
    head; codes 2*32*16/4 = 256, key scales and zeros 2*4*16*4 = 512, value scales and zeros 2*32*2*4 = 512, so
    (4096 - 1280) // (2*16*4 + 4) = 21 full-precision tokens fit. The residual is cut to 21 (and said so), and
    the cache, built and after a prompt and decode steps, is no larger than the unquantized one."""
    kvh, h, d, budget = 2, 4, 16, 32
    assert KVQuant(2, 8, 1000).largest_residual(budget, d, 4) == 21
    for spec in (KVQuant(2, 8, 1000), KVQuant(4, 8, 128), KVQuant(8, None, 1000)):
        policy = Quantized(StreamingLLM(budget=budget), spec.bits, spec.group, spec.residual)
        plan = resolve(policy, 1, kvh).sized(4096, 48).layers[0]
        plain_plan = resolve(StreamingLLM(budget=budget), 1, kvh).sized(4096, 48).layers[0]
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            cache = layer.init_layer_cache(plan, 1, kvh, d, jnp.float32)
        plain = layer.init_layer_cache(plain_plan, 1, kvh, d, jnp.float32)
        most = spec.largest_residual(budget, d, 4)
        assert cache.spec.residual == most < budget and cache.res_k.shape[2] == most
        assert any(f"residual={spec.residual} cut to {most} for a cache of {budget} slots" in str(w.message)
                   for w in said), [str(w.message) for w in said]
        assert cache.nbytes <= plain.nbytes, (spec, cache.nbytes, plain.nbytes)
        geom = layer.Geometry(layer=0, num_heads=h, num_kv_heads=kvh, head_dim=d, scale=d ** -0.5)
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.normal(size=(1, n, 48, d)), jnp.float32) for n in (h, kvh, kvh))
        _, cache = layer.prefill(geom, plan, cache, q, k, v, jnp.arange(48)[None])
        o, cache = layer.decode(geom, plan, cache, q[:, :, 0], k[:, :, 0], v[:, :, 0], jnp.asarray([48]))
        assert cache.spec.residual == most and cache.nbytes <= plain.nbytes
        assert np.isfinite(np.asarray(o)).all()
    assert KVQuant(4, 8, 8).fitted(64, d, jnp.float32) == KVQuant(4, 8, 8)  # a residual that fits is kept
    with pytest.raises(InvalidInput, match="takes more bytes quantized"):  # 1 slot pays a whole key group's scales
        quant.empty(KVQuant(4, 16), 1, 1, 1, d, jnp.bfloat16)


# ---- item 4: a quantized run's tables, legends and records name its width --------------------------------


def test_identity_a_quantized_run_names_its_width_in_every_table(tiny_dir, tmp_path, capsys):
    """`perplexity --policy full --kv-bits 2` wrote `| full | 7.221 |`, the full cache's name for a 2-bit cache:
    results.md, results.csv, the JSON summary and every record now say `full (2-bit KV)`, and the record's key (its
    identity) is the quantized policy's description. A plain run of the same name keeps `full`."""
    import json

    from kvjax.experiments import cli, perplexity

    for bits, label in ((2, "full (2-bit KV)"), (None, "full")):
        out = tmp_path / f"ppl{bits}"
        quant_args = ["--kv-bits", str(bits), "--kv-group", "8"] if bits else []
        code = cli.run(perplexity.main, ["--model", str(tiny_dir), "--policy", "full", *quant_args, "--lengths", "16",
                                         "--out", str(out)])
        assert code == 0, capsys.readouterr().err
        rows = [line.split("|")[1].strip() for line in (out / "results.md").read_text().splitlines()
                if line.startswith("| ") and not line.startswith("| policy")]
        assert rows == [label]
        assert (out / "results.csv").read_text().splitlines()[1].split(",")[0] == label
        assert list(json.loads((out / "results.json").read_text())["ppl"]) == [label]
        records = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
        assert [r["label"] for r in records] == [label]
        assert ("bits=2" in records[0]["id"]) == (bits == 2)


# ---- item 5: every numeric option of every policy is checked, by one check ---------------------------------


def _one_of_each_policy():
    """A valid instance of every policy class of kvjax.policies (the test below fails on a class missing here)."""
    from kvjax.policies import (
        H2O, KNorm, KVzip, PyramidKV, RazorAttention, SlimKV, SnapKV, TOVA, AdaKV, AnchorCache, ExpectedAttention,
        GateEviction, KeyDiff, LocalWindow, ObservedAttention, RKV, DMS, recompress)
    from kvjax.policies.anllm import AnchorReduction
    from kvjax.policies.chunkkv import ChunkKV
    from kvjax.policies.compose import ByLayer, HeadSplit, PerLayer
    from kvjax.policies.critical import CriticalAdaKV, CriticalKV
    from kvjax.policies.duo import DuoAttention, DuoAttentionOnce
    from kvjax.policies.scored import PromptStreamingLLM
    from kvjax.policies.kvzap import KVzap
    from kvjax.policies.kvzip import KVgrad
    from kvjax.policies.razor import CompensatedWindow
    from kvjax.surrogate import Surrogate

    from kvjax.policies.triattention import QueryCentres, TriAttention

    snap = SnapKV(budget=64)
    z = np.zeros((2, 2, 4), np.float32)
    centres = QueryCentres(mean_re=z, mean_im=z, abs_mean=z, omega=np.ones((2, 4), np.float32),
                           scale=np.ones(2, np.float32))
    surrogate = Surrogate("linear", ({"w": np.zeros((4, 1)), "b": np.zeros(1)},))
    return [AnchorReduction(anchor_ids=(5,)), ByLayer(split=1, shallow=StreamingLLM(budget=16), deep=FullCache()),
            PerLayer(layers=(FullCache(), FullCache())), HeadSplit(layers=((((0,), FullCache()), ((1,), snap)),)),
            DuoAttention(streaming=((True, False),)), DuoAttentionOnce(streaming=((True, False),)),
            PromptStreamingLLM(budget=16), GateEviction(), H2O(budget=16, recent=4),
            KVzip(ratio=0.5, repeat_ids=(1,), continue_ids=(2,), suffix_ids=()), AnchorCache(budget=16, anchor_slots=4),
            Quantized(FullCache(), bits=2, group=8, residual=4), CompensatedWindow(),
            RazorAttention(retrieval=((True, False),)), recompress(snap, 32), FullCache(),
            LocalWindow(size=16), StreamingLLM(budget=16), snap,
            PyramidKV(budget=64, observation_window=4, beta=2, num_layers=2), SlimKV(budget=64),
            ObservedAttention(budget=16), TOVA(budget=16), KNorm(budget=16), ExpectedAttention(budget=16),
            KeyDiff(budget=16), AdaKV(scorer=snap), CriticalKV(scorer=snap), CriticalAdaKV(scorer=snap),
            ChunkKV(scorer=snap), KVgrad(ratio=0.5, repeat_ids=(1,), continue_ids=(2,), suffix_ids=()),
            KVzap(surrogate=surrogate, threshold=-4.0), RKV(budget=16),
            DMS(scorer=KNorm(ratio=0.0), threshold=-1.0), TriAttention(budget=256, centres=centres)]


def test_reliability_every_numeric_policy_option_is_finite_and_in_range():
    """`ExpectedAttention(epsilon=nan)` kept a prefix and blanked the output and `PyramidKV(beta=nan)` passed its
    `beta < 1` check. Every numeric field of every policy class, set to NaN, is refused naming the class, the
    field and the value; inf too, except RazorAttention's compression (Table 1: the buffer alone); a ratio, alpha
    and epsilon out of their ranges are refused by the same check."""
    import dataclasses
    import importlib
    import inspect
    import math
    import pkgutil
    import warnings

    import kvjax.policies as pkg
    from kvjax.policies import AdaKV, ExpectedAttention, PyramidKV, SnapKV
    from kvjax.policies.base import Policy
    from kvjax.policies.razor import CompensatedWindow

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyramidKV says when it reduces to SnapKV
        samples = _one_of_each_policy()
    classes = {c for m in pkgutil.iter_modules(pkg.__path__) for c in vars(importlib.import_module(
        f"kvjax.policies.{m.name}")).values() if inspect.isclass(c) and issubclass(c, Policy)
        and dataclasses.is_dataclass(c) and c.__module__.startswith("kvjax.policies.")}
    abstract = {c for c in classes if not any(isinstance(s, c) for s in samples)}
    assert {c.__name__ for c in abstract} <= {"RingPolicy", "ScoredPolicy", "DelayedEviction"}, abstract  # bases
    checked = 0
    for policy in samples:
        for field in dataclasses.fields(policy):
            value = getattr(policy, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            for bad in (math.nan, math.inf, -math.inf):
                if bad == math.inf and field.name == "compression":
                    continue
                shown = "compression (C)" if field.name == "compression" else field.name  # RazorAttention's symbol
                with pytest.raises(InvalidInput, match=re.escape(f"{type(policy).__name__}: {shown}={bad} must be ")):
                    dataclasses.replace(policy, **{field.name: bad})
                checked += 1
    assert checked > 60
    assert CompensatedWindow(compression=math.inf).compression == math.inf
    for make, message in ((lambda: ExpectedAttention(budget=8, epsilon=-1.0), "epsilon=-1.0 must be a finite number >= 0"),
                          (lambda: PyramidKV(budget=64, observation_window=4, beta=float("nan"), num_layers=2),
                           "beta=nan must be a finite number"),
                          (lambda: AdaKV(scorer=SnapKV(budget=64), alpha=1.5), "alpha=1.5 must be in"),
                          (lambda: SnapKV(ratio=float("nan")), "ratio=nan must be in [0, 1)")):
        with pytest.raises(InvalidInput, match=re.escape(message)):
            make()


# ---- item 6: the layer API never overruns a plan that keeps every token -----------------------------------


def test_reliability_layer_api_refuses_to_overrun_a_full_cache():
    """A FullCache sized for 20 tokens kept the last 20 of a 40-token prompt in `layer.prefill` (a window) and
    decoding past 20 overwrote positions 0-3. The prompt is refused at trace time (under jit too: its length is
    a shape); a decode step past the size is refused when its positions are concrete, and under jit (positions
    traced) returns NaN for that row, never attention over a wrapped cache. A window policy of the same size still
    evicts, as it should, and a step inside the size is untouched (the NumPy attention over the 21 tokens)."""
    kvh, h, d = 2, 4, 16
    geom = layer.Geometry(layer=0, num_heads=h, num_kv_heads=kvh, head_dim=d, scale=d ** -0.5)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, n, 40, d)), jnp.float32) for n in (h, kvh, kvh))
    plan = resolve(FullCache(), 1, kvh).sized(21, 20).layers[0]
    empty = layer.init_layer_cache(plan, 1, kvh, d, jnp.float32)
    prefill = lambda c, q, k, v, p: layer.prefill(geom, plan, c, q, k, v, p)  # noqa: E731
    for run in (prefill, jax.jit(prefill)):
        with pytest.raises(InvalidInput, match=re.escape("FullCache(positions='absolute', prefill_mode='full') keeps "
                                                         "every token, and its cache was sized for 21; a prompt of 40 "
                                                         "tokens does not fit")):
            run(empty, q, k, v, jnp.arange(40)[None])
    _, cache = layer.prefill(geom, plan, empty, q[:, :, :20], k[:, :, :20], v[:, :, :20], jnp.arange(20)[None])
    step = lambda c, i: layer.decode(geom, plan, c, q[:, :, i], k[:, :, i], v[:, :, i], jnp.asarray([i]))  # noqa: E731
    o, full = step(cache, 20)
    keys, values = np.asarray(k[0, :, :21]), np.asarray(v[0, :, :21])
    logits = np.einsum("kgd,ktd->kgt", np.asarray(q[0, :, 20]).reshape(kvh, h // kvh, d), keys) * d ** -0.5
    p = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("kgt,ktd->kgd", p / p.sum(-1, keepdims=True), values).reshape(h, d)
    np.testing.assert_allclose(np.asarray(o[0]), want, atol=1e-5)
    with pytest.raises(InvalidInput, match="a token at position 21 is past it"):
        step(full, 21)
    o, _ = jax.jit(step, static_argnums=())(full, jnp.asarray(21))
    assert np.isnan(np.asarray(o)).all()
    o, _ = jax.jit(step)(cache, jnp.asarray(20))
    np.testing.assert_allclose(np.asarray(o[0]), want, atol=1e-5)
    window = resolve(StreamingLLM(budget=21), 1, kvh).sized(64, 40).layers[0]  # evicting is its method
    o, _ = layer.prefill(geom, window, layer.init_layer_cache(window, 1, kvh, d, jnp.float32), q, k, v,
                         jnp.arange(40)[None])
    assert np.isfinite(np.asarray(o)).all()


# ---- item 7: sampling is right at every finite temperature > 0 ---------------------------------------------


def test_nonfinite_sampling_at_any_temperature_is_never_overflowed():
    """`--temperature 1e-38` gave garbage: `logits / T` overflowed to inf and `categorical` took the first inf.
    At temperatures that overflow float32 (1e-38, 1e-45, 5e-324: the last flushes to 0) sampling is the limit,
    greedy: the argmax of every row, with or without top-p; at ordinary temperatures it draws exactly what
    `jax.random.categorical(key, logits / T)` draws (the shift by the maximum changes no draw); at a huge one,
    finite tokens spread over the vocabulary."""
    from kvjax.generate import Sampling, sample

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 50)) * 5, jnp.float32)
    logits = logits.at[1, 7].set(3e38)  # a row whose maximum is near float32's largest
    greedy = np.asarray(jnp.argmax(logits, axis=-1))
    for t in (1e-38, 1e-45, 5e-324, 1e-30):
        for top_p in (1.0, 0.9):
            for seed in range(5):
                got = sample(logits, jax.random.key(seed), Sampling(temperature=t, top_p=top_p))
                np.testing.assert_array_equal(np.asarray(got), greedy, err_msg=f"T={t}, top_p={top_p}")
    ordinary = logits.at[1, 7].set(0.0)
    for t in (1.0, 0.7, 2.5):
        for seed in range(5):
            want = jax.random.categorical(jax.random.key(seed), ordinary / t, axis=-1)
            np.testing.assert_array_equal(np.asarray(sample(ordinary, jax.random.key(seed), Sampling(temperature=t))),
                                          np.asarray(want))
    spread = {int(sample(ordinary, jax.random.key(s), Sampling(temperature=1e30))[0]) for s in range(200)}
    assert len(spread) > 30 and all(0 <= x < 50 for x in spread)


# ---- item 9: only a folder's own record makes it kvjax's ---------------------------------------------------


def test_lock_a_folder_is_kvjax_only_by_its_own_record(tiny_dir, tmp_path):
    """A folder of the user's files holding an old run's folder (with its identity.json) counted as kvjax's, and
    its results.md was overwritten. Only OUT/identity.json makes OUT kvjax's: the folder is refused and left as
    it was; a folder with its own record is still resumed."""
    import json

    from kvjax.experiments.records import claim_results_dir
    from kvjax.models import load

    lm = load(tiny_dir)
    mine = tmp_path / "notes"
    (mine / "old_run").mkdir(parents=True)
    (mine / "results.md").write_text("my notes\n")
    (mine / "old_run" / "identity.json").write_text(json.dumps({"kvjax": "0"}))
    before = {p: p.read_bytes() for p in mine.rglob("*") if p.is_file()}
    with pytest.raises(InvalidInput, match=re.escape(f"--out {mine} holds files kvjax did not write (old_run, "
                                                     "results.md) and no identity.json")):
        claim_results_dir(mine, lm, {})
    assert {p: p.read_bytes() for p in mine.rglob("*") if p.is_file()} == before
    ours = tmp_path / "ours"
    claim_results_dir(ours, lm, {"--seed": 0})
    (ours / "runs.jsonl").write_text("{}\n")
    assert claim_results_dir(ours, lm, {"--seed": 0})["--seed"] == 0


# ---- item 10: every benchmark's entry point goes through the one handler ----------------------------------


def _main_block_calls(path) -> set[str]:
    """The dotted names of the calls in a script's `if __name__ == "__main__":` block."""
    import ast

    calls = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            calls |= {ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)}
    return calls


def test_cli_error_every_benchmark_ends_through_the_cli_handler(tmp_path):
    """`benchmarks.e2e --model smollm2` before a fetch was a traceback: no benchmark went through `kvjax.cli.run`.
    Every benchmarks/*.py and experiments suite with a `__main__` block ends through it, and a user error is one
    line on stderr with exit status 2 (the model not fetched; a missing model directory)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    scripts = [p for d in ("benchmarks", "kvjax/experiments") for p in sorted((repo / d).rglob("*.py"))
               if '__name__ == "__main__"' in p.read_text()]
    assert len([p for p in scripts if p.parent.name == "benchmarks"]) >= 10
    missing = [str(p.relative_to(repo)) for p in scripts if "cli.run" not in _main_block_calls(p)]
    assert missing == [], missing
    env = dict(os.environ, KVJAX_HOME=str(tmp_path / "home"), JAX_PLATFORMS="cpu")
    for argv, line in ((["benchmarks.e2e", "--model", "smollm2", "--no-torch", "--out", str(tmp_path / "e2e")],
                        "error: model 'smollm2' is not fetched yet ("),
                       (["benchmarks.kvzip", "--model", str(tmp_path / "nowhere")],
                        f"error: model directory '{tmp_path / 'nowhere'}' does not exist")):
        res = subprocess.run([sys.executable, "-m", *argv], cwd=repo, env=env, capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 2, res.stderr
        assert one_error_line(res.stderr).startswith(line), res.stderr


# ---- item 13: --duo-pattern files are read or refused in one line ------------------------------------------


def test_cli_error_duo_pattern_faults_end_in_one_line(tiny_dir, tmp_path, capsys):
    """--duo-pattern with bad JSON, a ragged score table, or a pattern folder whose config.json has no sink_size or
    a non-number was a traceback (JSONDecodeError, ValueError, KeyError); `int(1.5)` silently made 1 sink. Each is
    one line naming the file (and key), exit 2; a good pattern still runs."""
    import json

    from kvjax.experiments import cli
    from kvjax.experiments import generate as gen_cli

    def folder(name, config, tsv="1\t0\n0\t1\n"):
        d = tmp_path / name
        d.mkdir()
        (d / "full_attention_heads.tsv").write_text(tsv)
        (d / "config.json").write_text(json.dumps(config))
        return d

    bad_json, ragged = tmp_path / "bad.json", tmp_path / "ragged.json"
    bad_json.write_text('{"duo_scores": [[0.1, 0.2], [')
    ragged.write_text(json.dumps({"duo_scores": [[0.1, 0.2], [0.3]]}))
    cases = [(bad_json, f"{bad_json} is not a JSON file (Expecting value: line 1 column 30 (char 29))"),
             (ragged, f"{ragged}: duo_scores is not a [layers, kv_heads] table of numbers"),
             (folder("nosink", {"recent_size": 8}), "config.json has no 'sink_size' (a whole number of tokens)"),
             (folder("text", {"sink_size": "many", "recent_size": 8}), "sink_size='many' must be a whole number"),
             (folder("half", {"sink_size": 1.5, "recent_size": 8}), "sink_size=1.5 must be a whole number"),
             (folder("tsv", {"sink_size": 4, "recent_size": 8}, tsv="1\t0\n0\n"), "unreadable DuoAttention head table")]
    for pattern, message in cases:
        code = cli.run(gen_cli.main, ["--model", str(tiny_dir), "--policy", "duo", "--duo-pattern", str(pattern),
                                      "--max-new-tokens", "1", "hi"])
        err = capsys.readouterr().err
        assert code == 2 and one_error_line(err).startswith("error: --policy duo: "), err
        assert message in err, err
    good = folder("good", {"sink_size": 4, "recent_size": 8})
    assert cli.run(gen_cli.main, ["--model", str(tiny_dir), "--policy", "duo", "--duo-pattern", str(good),
                                  "--max-new-tokens", "1", "hi"]) == 0
    assert "DuoAttention" in capsys.readouterr().out


# ---- items 14 and 15: a prompt that is not UTF-8; a number of new tokens past int32 or the machine ---------


def test_cli_error_a_prompt_that_is_not_utf8_is_one_line(capsys):
    """A Latin-1 shell hands `café` as bytes Python keeps as a lone surrogate; the tokenizer raised a TypeError.
    The prompt (and the needle suite's --needle / --question) is refused where it is parsed, naming the byte."""
    from kvjax.experiments import generate as gen_cli
    from kvjax.experiments import needle

    for main, argv in ((gen_cli.main, ["caf\udce9"]), (needle.main, ["--needle", "caf\udce9"])):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2
        assert one_error_line(err).endswith("b'caf\\xe9' is not UTF-8 (byte 0xe9 at character 3); set a UTF-8 "
                                            "locale (LANG=C.UTF-8) or convert the text"), err


def test_reliability_new_tokens_past_int32_or_memory_are_refused_before_allocating(tiny_dir, tiny, capsys,
                                                                                  monkeypatch):
    """`--max-new-tokens 100000000000` was an OverflowError (int32), and a number that fits int32 but not the
    machine would allocate until the process died. Both are refused before anything is allocated: past int32 by
    the bucketed span, past memory by the caches' shapes (`jax.eval_shape`) and the token buffer; a budget policy
    whose cache fits still runs."""
    from kvjax.experiments import cli
    from kvjax.experiments import generate as gen_cli
    import sys

    from kvjax.generate import generate

    gen = sys.modules["kvjax.generate"]  # the module (kvjax.generate is also the function's name)

    code = cli.run(gen_cli.main, ["--model", str(tiny_dir), "--max-new-tokens", "100000000000", "--positions",
                                  "rolling", "hi"])
    assert code == 2 and one_error_line(capsys.readouterr().err) == (
        "error: max_new_tokens=100000000000: the prompt and the new tokens, rounded up to their buckets, span "
        "137438953488 positions, past int32's largest (2147483647); generate fewer tokens")
    with pytest.raises(InvalidInput, match=r"span 2147483664 positions, past int32's largest"):
        generate(tiny.model, [[5, 6]], StreamingLLM(budget=16, positions="rolling"), max_new_tokens=2_000_000_000)
    # 10**9 tokens under a full cache: 2 layers x 2 KV heads x 2**30 slots x (2 x 16 x 4 + 8) bytes, ~544 GiB
    with pytest.raises(InvalidInput, match=r"need 5\d\d\.\d GiB, more than the"):
        generate(tiny.model, [[5, 6]], FullCache(positions="rolling"), max_new_tokens=10**9)
    monkeypatch.setattr(gen, "memory_bytes", lambda mesh=None: 2**20)  # a 1 MiB machine
    with pytest.raises(InvalidInput, match=r"1 cache\(s\) of \d+ slots for 1 row\(s\) and a 2048-token buffer need "):
        generate(tiny.model, [[5, 6]], FullCache(), max_new_tokens=2048)
    assert generate(tiny.model, [[5, 6]], StreamingLLM(budget=16), max_new_tokens=4, eos_ids=()).lengths.tolist() == [4]


# ---- item 16: --out through a symlink loop; LongBench data that is not UTF-8 ------------------------------


def test_cli_error_out_symlink_loop_and_non_utf8_longbench_are_one_line(tiny_dir, tmp_path, capsys):
    """`--out` a symbolic link to itself (or below one) was a RuntimeError from `Path.resolve`, a dangling one
    "cannot be created (File exists)"; a LongBench .jsonl converted to Latin-1 was a UnicodeDecodeError. Each is
    one line naming the path (and the line of the file), exit 2, and nothing is written."""
    import json
    import os

    from kvjax.experiments import cli, perplexity
    from kvjax.experiments.longbench import __main__ as longbench

    loop, dangling = tmp_path / "loop", tmp_path / "dangling"
    os.symlink(loop, loop)
    os.symlink(tmp_path / "nowhere", dangling)
    for out, message in ((loop, f"--out {loop} is a symbolic link that loops or leads nowhere (to {loop})"),
                         (loop / "sub", f"--out {loop / 'sub'} cannot be resolved: a symbolic link on its path loops"),
                         (dangling, f"--out {dangling} is a symbolic link that loops or leads nowhere")):
        code = cli.run(perplexity.main, ["--model", str(tiny_dir), "--policy", "full", "--lengths", "16", "--out",
                                         str(out)])
        assert code == 2 and one_error_line(capsys.readouterr().err).startswith(f"error: {message}")
    assert not (tmp_path / "nowhere").exists()
    data = tmp_path / "lb"
    data.mkdir()
    row = dict(input="q", context="c", answers=["a"], length=1, dataset="narrativeqa", language="en")
    (data / "narrativeqa.jsonl").write_bytes((json.dumps(row) + "\n").encode() + '{"input": "caf\xe9"}\n'.encode("latin-1"))
    code = cli.run(longbench.main, ["--model", str(tiny_dir), "--policy", "full", "--data-dir", str(data), "--datasets",
                                    "narrativeqa",
                                    "--out", str(tmp_path / "lb_out")])
    err = capsys.readouterr().err  # the suite's progress bar comes first
    assert code == 2 and "Traceback" not in err and [x for x in err.splitlines() if "error" in x] == [
        f"error: {data / 'narrativeqa.jsonl'}:2: not UTF-8 text (invalid continuation byte, byte 0xe9 at offset "
        f"{len(json.dumps(row)) + 1 + 14})"]


# ---- item 20: the layer API names a wrong argument and the shape it expects ---------------------------------


def test_cli_error_layer_api_names_the_argument_and_shape_expected():
    """Positions without the batch axis were an IndexError, TypeError or unpack error; GateEviction without
    `gate_keep` a TypeError on None; AnchorReduction without `tokens` "None is not a valid value". Each is refused
    before tracing anything else, naming the argument and the shape expected."""
    from kvjax.policies import GateEviction
    from kvjax.policies.anllm import AnchorReduction

    kvh, h, d, t = 2, 4, 16, 12
    geom = layer.Geometry(layer=0, num_heads=h, num_kv_heads=kvh, head_dim=d, scale=d ** -0.5)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, n, t, d)), jnp.float32) for n in (h, kvh, kvh))
    plan = resolve(FullCache(), 1, kvh).sized(32, t).layers[0]
    cache = layer.init_layer_cache(plan, 1, kvh, d, jnp.float32)
    pos = jnp.arange(t)
    expect = {
        "prefill": ("pos has shape (12,); expected [b, t] = (1, 12) (h = 4, kvh = 2, d = 16; positions keep the "
                    "batch axis, -1 on padding)",
                    lambda: layer.prefill(geom, plan, cache, q, k, v, pos)),
        "chunk": ("q has shape (4, 12, 16); expected [b, h, t, d]", lambda: layer.chunk(geom, plan, cache, q[0], k, v,
                                                                                        pos[None], None)),
        "decode": ("pos has shape (); expected [b] = (1,)",
                   lambda: layer.decode(geom, plan, cache, q[:, :, 0], k[:, :, 0], v[:, :, 0], jnp.asarray(3))),
    }
    for call, (message, run) in expect.items():
        with pytest.raises(InvalidInput, match=re.escape(f"layer.{call}: {message}")):
            run()
    gate = resolve(GateEviction(), 1, kvh).sized(32, t).layers[0]
    with pytest.raises(InvalidInput, match=re.escape("keeps what the Attention-Gates keep: pass gate_keep, their flags "
                                                     "(bool [b, kvh, t] = (1, 2, 12); kvjax.gate), got none")):
        layer.prefill(geom, gate, layer.init_layer_cache(gate, 1, kvh, d, jnp.float32), q, k, v, pos[None])
    anllm = resolve(AnchorReduction(anchor_ids=(5,), anchor_slots=4, sequence=8, prefill_mode="stream"), 1, kvh)
    anllm = anllm.sized(32, t).layers[0]
    with pytest.raises(InvalidInput, match=r"^layer\.decode: AnchorReduction\(.*\) reads the token ids: pass tokens "
                                           + re.escape("([b] = (1,), the ids at pos)")):
        layer.decode(geom, anllm, layer.init_layer_cache(anllm, 1, kvh, d, jnp.float32), q[:, :, 0], k[:, :, 0],
                     v[:, :, 0], jnp.asarray([0]))


# ---- item 21: no false "indexing errors" warning; no negative positions in the advice -----------------------


def test_cli_error_a_long_prompt_gets_kvjax_words_only(tiny_dir, tmp_path, capsys):
    """transformers warned that a prompt past the tokenizer's model_max_length "will result in indexing errors"
    before kvjax's own handling of it (with --truncate, where it is false); `--truncate --max-new-tokens 600` on a
    512-position model advised that 600 new tokens "leave -88 positions for the prompt". Through an entry point,
    a tokenizer of model_max_length 16 says nothing of a 40-token prompt that kvjax runs (no such record reaches
    transformers' handlers), and too many new tokens are refused in one line that gives no negative count."""
    import json
    import logging
    import shutil

    from kvjax.experiments import cli
    from kvjax.experiments import generate as gen_cli

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(cfg | {"model_max_length": 16}))
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("transformers.tokenization_utils_base")
    logger.addHandler(handler)
    try:
        code = cli.run(gen_cli.main, ["--model", str(model), "--truncate", "--max-new-tokens", "2",
                                      "the quick brown fox jumps over the lazy dog " * 4])
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert code == 0, err
    assert not [m for m in said if "indexing errors" in m] and "indexing errors" not in err, said
    code = cli.run(gen_cli.main, ["--model", str(model), "--truncate", "--max-new-tokens", "5000", "hello"])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and "generate fewer tokens (max_new_tokens=5000 leaves no positions for the prompt; at most 4094 " \
        "leave room for a 2-token prompt)" in line and not re.search(r"-\d", line), line


# ---- item 23: --help says what --model takes, in whole sentences ------------------------------------------


def test_cli_error_help_names_every_model_form_in_whole_sentences(capsys):
    """`--model`'s help said "local Hugging Face directory" (or nothing) in all 14 suites and trainers, never a
    .gguf file or smollm2; `benchmarks.e2e --help` stopped mid-sentence (its docstring's first line). Every entry
    point's description is its docstring's whole first paragraph, and every --model help names the three forms."""
    import ast
    import importlib
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    scripts = [p for d in ("benchmarks", "kvjax/experiments") for p in sorted((repo / d).rglob("*.py"))
               if '__name__ == "__main__"' in p.read_text() and p.name != "tpu_aot.py"]  # tpu_aot: the TPU's
    with_model = []
    for path in scripts:
        name = ".".join(path.relative_to(repo).with_suffix("").parts)
        module = importlib.import_module(name)
        with pytest.raises(SystemExit) as stop:
            module.main(["--help"])
        assert stop.value.code == 0, name
        text = " ".join(capsys.readouterr().out.split())
        paragraph = " ".join(ast.get_docstring(ast.parse(path.read_text())).split("\n\n")[0].split())
        paragraph = paragraph[:-1] + "." if paragraph.endswith(":") else paragraph  # a list's introduction
        assert paragraph in text and paragraph.endswith((".", ")")), (name, paragraph)
        if "--model" in text:
            with_model.append(name)
            assert ".gguf file" in text and "smollm2" in text, name
    assert len(with_model) >= 16, with_model
