"""Each paper's headline protocols end to end on a tiny model, as a researcher runs them: the command
runs, a rerun computes nothing new (resume), a part lost to a kill is recomputed alone, and another
configuration is refused for the same OUT or recorded apart (identity).

MAT Table 2 / Fig. 4 is in tests/test_zeroshot.py, MAT Table 3's average over sequences in
tests/test_perplexity.py, AnLLM Table 3's placements in tests/test_anllm.py, RazorAttention Table 1's
head files in tests/test_razor.py and RULER's --ratios in tests/test_ruler.py; here the remaining
protocols run through their suites.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from kvjax.experiments import efficiency, eval_anllm, eval_gate, find_heads, passkey
from tests.conftest import prefill_policy


def _lines(path):
    return path.read_text().splitlines()


def test_mat_table_6_streaming_throughput_with_rolling_positions(tiny_dir, tmp_path):
    """`efficiency --positions rolling --prefill-mode stream`: StreamingLLM and MAT hold the same cache
    whatever the stream's length; a rerun keeps the timed cells; another --new is refused."""
    out = tmp_path / "eff"
    argv = ["--model", str(tiny_dir), "--compare", "streaming,mat", "--positions", "rolling", "--prefill-mode",
            "stream", "--budget", "16", "--anchor-slots", "4", "--sinks", "2", "--lengths", "48,96", "--new", "4",
            "--repeats", "1", "--out", str(out)]
    assert efficiency.main(argv) == 0
    cells = _lines(out / "cells.jsonl")
    assert (out / "results.md").is_file() and (out / "efficiency.png").is_file()
    by = {(c["policy"].split("(")[0], c["length"]): c for c in map(json.loads, cells)}
    assert len(by) == 4 and all("positions='rolling'" in c["policy"] for c in by.values())
    for name in ("StreamingLLM", "ByLayer"):  # MAT is ByLayer(shallow=StreamingLLM, deep=AnchorCache)
        assert by[(name, 48)]["cache_bytes"] == by[(name, 96)]["cache_bytes"]  # bounded by the budget
    # c = 16 slots per KV head either way; MAT's deep layer (1 of the tiny model's 2) also keeps each slot's pi
    pi_bytes = 1 * 2 * 16 * 4  # deep layers x KV heads x slots x float32
    assert by[("ByLayer", 96)]["cache_bytes"] - by[("StreamingLLM", 96)]["cache_bytes"] == pi_bytes
    assert efficiency.main(argv) == 0
    assert _lines(out / "cells.jsonl") == cells  # resumed: nothing re-timed
    with pytest.raises(ValueError, match="--new"):
        efficiency.main([a if a != "4" else "5" for a in argv])


def test_slimkv_table_3_ablations_through_a_suite(tiny_dir, tmp_path):
    """SlimKV's S1-only and S2-only ablations (`--combine s1|s2`) beside eq. 5's product in one OUT: each
    a record of its own (the description names `combine`), a rerun computes nothing."""
    out = tmp_path / "pk"
    base = ["--model", str(tiny_dir), "--lengths", "300", "--depths", "0.5", "--samples", "1", "--out", str(out),
            "--policy", "slimkv", "--budget", "64", "--observation-window", "8"]
    for combine in ("s1", "s2", "product"):
        assert passkey.main(base + ["--combine", combine]) == 0
    records = [json.loads(x) for x in _lines(out / "samples.jsonl")]
    assert sorted(r["policy"].split("combine=")[1].split(",")[0] for r in records) == ["'product'", "'s1'", "'s2'"]
    assert passkey.main(base + ["--combine", "s2"]) == 0
    assert len(_lines(out / "samples.jsonl")) == 3
    # The ablations really rank differently: S2 alone keeps, besides the window, the prefix tokens of the
    # largest max |v| (read from a full cache's values), and S1 alone keeps another set.
    import jax.numpy as jnp

    from kvjax import FullCache, cache as kvcache
    from kvjax.policies import SlimKV
    from kvjax.models import load

    model = load(tiny_dir).model
    ids = jnp.asarray(np.random.default_rng(4).integers(4, model.cfg.vocab_size, (1, 96)), jnp.int32)
    pos = jnp.arange(96, dtype=jnp.int32)[None]
    _, full = prefill_policy(model, ids, pos, FullCache(), 97)
    kept = {c: kvcache.kept_positions(prefill_policy(model, ids, pos, SlimKV(budget=24, observation_window=8, kernel=1,
                                                                      combine=c), 97)[1])
            for c in ("s1", "s2", "product")}
    for layer, lc in enumerate(full):
        vmax = np.abs(np.asarray(lc.v[0])).max(axis=-1)  # [kvh, slots]: slot i holds position i
        for h in range(vmax.shape[0]):
            top = np.argsort(-vmax[h, :88], kind="stable")[:16]
            assert sorted(set(top.tolist()) | set(range(88, 96))) == \
                [int(p) for p in np.asarray(kept["s2"][layer])[0, h] if p >= 0]
    assert any(not np.array_equal(a, b) for a, b in zip(kept["s1"], kept["s2"]))


def test_attention_gate_table_1_fixed_eviction_resumes_part_by_part(tiny_dir, tmp_path):
    """`eval_gate --baseline-eviction 0.5`: the baselines keep half of the prefix; each part is a record,
    a part lost to a kill is recomputed alone with the same numbers, and a rerun at another eviction is
    refused for that OUT."""
    from kvjax.gate import save_gates
    from tests.test_gate import _gated

    gates = tmp_path / "gates"
    save_gates(_gated(tiny_dir), gates)
    out = tmp_path / "eval"
    argv = ["--model", str(tiny_dir), "--gate-params", str(gates), "--windows", "2", "--seq-len", "32",
            "--baseline-eviction", "0.5", "--out", str(out)]
    assert eval_gate.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["baseline_eviction"] == 0.5
    assert all(abs(res["kept_prefix"][n] - 0.5) <= 1 / res["prefix"] for n in ("local", "streaming", "h2o"))
    assert set(res["continuation_nll"]) == {"full", "gate", "local", "streaming", "h2o"}
    parts = _lines(out / "parts.jsonl")
    assert len(parts) == 6  # the held-out losses and five continuations
    (out / "parts.jsonl").write_text("\n".join(parts[:-1]) + "\n")  # killed before the last part
    assert eval_gate.main(argv) == 0
    again = _lines(out / "parts.jsonl")
    assert again[:-1] == parts[:-1] and json.loads(again[-1])["nll"] == pytest.approx(json.loads(parts[-1])["nll"])
    assert json.loads((out / "results.json").read_text())["continuation_nll"] == pytest.approx(res["continuation_nll"])
    with pytest.raises(ValueError, match="--baseline-eviction"):
        eval_gate.main([a if a != "0.5" else "0.25" for a in argv])


def test_anllm_table_1_on_a_local_multiple_choice_file(tiny_dir, tmp_path):
    """`eval_anllm --data items.jsonl` (Table 1 on the user's own items): runs, resumes, and a changed
    data file's content is refused for that OUT."""
    data = tmp_path / "items.jsonl"
    demos = ["Ada keeps the red key.", "Bo keeps the blue key.", "Cy keeps the gold key."]
    rows = [{"demos": demos, "query": "Bo keeps the", "options": [" red", " blue", " gold"], "answer": 1},
            {"query": "Cy keeps the", "options": [" red", " blue", " gold"], "answer": 2},
            {"demos": demos[:1], "query": "Ada keeps the", "options": [" red", " blue"], "answer": 0}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "an"
    argv = ["--model", str(tiny_dir), "--anchor-tokens", ".", "--data", str(data), "--time-items", "0", "--out", str(out)]
    assert eval_anllm.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    # each item reads its own demonstrations (line 2 the ones above it): 3, 3 and 1 sentence-final anchors
    assert res["items"] == 3 and res["L_kv"] == pytest.approx((3 + 3 + 1) / 3)
    from kvjax import fewshot
    from kvjax.fewshot import Item
    from kvjax.models import load

    lm = load(tiny_dir)
    enc = lambda s: lm.tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    own = enc(demos[0])
    item = Item(tuple(enc(rows[2]["query"])), tuple(tuple(enc(o)) for o in rows[2]["options"]), 0)
    (last,) = [json.loads(x) for x in _lines(out / "items.jsonl") if json.loads(x)["i"] == 2]
    np.testing.assert_allclose(last["full"], fewshot.full_scores(lm.model, own, item), rtol=1e-5)
    items = _lines(out / "items.jsonl")
    assert eval_anllm.main(argv) == 0 and _lines(out / "items.jsonl") == items
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    with pytest.raises(ValueError, match="--data content"):
        eval_anllm.main(argv)


def test_razor_table_1_head_protection_through_a_suite(tiny_dir, tmp_path):
    """Table 1's controls as suite runs: the probe's heads, as many random heads, and none, each a
    RazorAttention whose description names its head table, so the three sit apart in one OUT; a rerun
    computes nothing."""
    out = tmp_path / "pk"
    for control in (None, "random", "none"):
        heads = tmp_path / f"{control}.json"
        argv = ["--model", str(tiny_dir), "--out", str(heads), "--k", "32", "--repeats", "3", "--induction-ratio",
                "0.2"]
        assert find_heads.main(argv + (["--control", control] if control else [])) == 0
        assert passkey.main(["--model", str(tiny_dir), "--lengths", "300", "--depths", "0.5", "--samples", "1",
                             "--out", str(out), "--policy", "razor", "--heads", str(heads), "--buffer", "16",
                             "--compression", "8"]) == 0
    records = [json.loads(x) for x in _lines(out / "samples.jsonl")]
    assert len({r["policy"] for r in records}) == 3 and all("RazorAttention" in r["policy"] for r in records)
    # what each control protects: the probe's heads, as many others drawn at random, none
    tables = {c: np.asarray(json.loads((tmp_path / f"{c}.json").read_text())["retrieval_kv_heads"], bool)
              for c in (None, "random", "none")}
    n = int(tables[None].sum())
    assert n > 0 and int(tables["random"].sum()) == n and not (tables["random"] & tables[None]).any()
    kept = sorted(int(re.search(r"(\d+)/\d+ KV heads kept whole", r["policy"]).group(1)) for r in records)
    assert kept == [0, n, n]
    assert passkey.main(["--model", str(tiny_dir), "--lengths", "300", "--depths", "0.5", "--samples", "1",
                         "--out", str(out), "--policy", "razor", "--heads", str(tmp_path / "none.json"), "--buffer",
                         "16", "--compression", "8"]) == 0
    assert len(_lines(out / "samples.jsonl")) == 3
