"""The suite driver (issue #22, item 6): a suite is a typed function, called the same way by its
command line and by `kvjax.experiments.report`; errors name what the caller wrote (a keyword from Python,
a flag from the shell); a Python call and a command line share a results directory."""

from __future__ import annotations

import ast
import inspect
import textwrap
import json

import pytest

from kvjax.experiments import cli, driver, passkey, report
from kvjax.experiments.driver import ArgumentError, SuiteResult
from kvjax.errors import InvalidInput
from kvjax.policies import FullCache, StreamingLLM


@pytest.fixture(scope="module")
def lm(tiny_dir):
    return driver.load_model(tiny_dir)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_suite_called_from_python_returns_its_tables_and_shares_its_directory_with_the_cli(lm, tiny_dir,
                                                                                          tmp_path, capsys):
    out = tmp_path / "pk"
    pols = driver.resolve_policies("full,streaming", budget=32)
    assert pols["full"] == FullCache() and pols["streaming"] == StreamingLLM(budget=32, sinks=4)
    res = passkey.suite(lm, pols, out, lengths=[300], depths=[0.5], samples=1, progress=False)
    assert isinstance(res, SuiteResult) and res.suite == "passkey" and res.out == out
    # the typed result is what the files say, not a second computation
    assert res.summary == json.loads((out / "results.json").read_text())
    assert (out / "results.md").read_text().rstrip("\n") == res.table.rstrip("\n")
    assert res.policies == {"full": FullCache().describe(), "streaming": pols["streaming"].describe()}
    assert res.figures == (out / "results.png",) and res.figures[0].is_file()
    recs = _records(out / "samples.jsonl")
    assert len(recs) == 2
    for r in recs:  # one sample per policy; its accuracy cell is that sample's verdict
        assert res.summary[r["policy"]] == {"300": {"0.5": float(r["correct"])}}
    # The command line with the same options resumes the Python call's records: one identity.
    argv = ["--model", str(tiny_dir), "--lengths", "300", "--depths", "0.5", "--samples", "1", "--out", str(out)]
    assert cli.run(passkey.main, argv) == 0
    assert _records(out / "samples.jsonl") == recs
    capsys.readouterr()
    # and another seed is refused from Python naming the keyword (the shell's refusal names --seed)
    with pytest.raises(InvalidInput, match=r"\(seed=: 0 -> 1\); pass a new out= or delete"):
        passkey.suite(lm, pols, out, lengths=[300], depths=[0.5], samples=1, seed=1, progress=False)
    code = cli.run(passkey.main, argv + ["--seed", "1"])
    assert code == 2 and "(--seed: 0 -> 1); pass a new --out or delete" in capsys.readouterr().err


def test_errors_name_the_keyword_from_python_and_the_flag_from_the_command_line(lm, tiny_dir, tmp_path, capsys):
    with pytest.raises(ArgumentError, match=r"lengths=\[4093\] \+ 8 generated tokens exceed"):
        passkey.suite(lm, [FullCache()], tmp_path / "a", lengths=[4093])
    with pytest.raises(SystemExit):
        passkey.main(["--model", str(tiny_dir), "--lengths", "4093", "--out", str(tmp_path / "b")])
    assert "--lengths [4093] + 8 generated tokens exceed" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before claiming OUT
    with pytest.raises(InvalidInput, match="kernel=: no policy of streaming takes it"):
        driver.resolve_policies("streaming", budget=32, kernel=5)
    with pytest.raises(InvalidInput, match="budget=8: no policy of full takes a budget"):
        driver.resolve_policies("full", budget=8)
    with pytest.raises(TypeError, match="lenghts"):  # a typo in a keyword is Python's own error
        passkey.suite(lm, [FullCache()], tmp_path / "c", lenghts=[300])


def test_as_flags_rewrites_only_the_parsers_options():
    msg = "lengths=[9] + new=8 exceed max_position_embeddings=4096 (prefill_mode=stream lifts it)"
    assert driver.as_flags(msg, {"lengths", "new", "prefill_mode"}) == (
        "--lengths [9] + --new 8 exceed max_position_embeddings=4096 (--prefill-mode stream lifts it)")


def test_a_name_given_twice_is_labelled_by_position():
    pols = driver.resolve_policies(["streaming", "streaming"], budget=16)
    assert list(pols) == ["streaming#0", "streaming#1"]


def test_the_report_calls_the_suites_as_functions():
    """No suite is run through its argv `main`, and no suite's results are read back from its files."""
    tree = ast.parse(inspect.getsource(report))
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "main" not in used and {"suite", "find", "resolve_policies", "load_model"} <= used
    # the suites' sections read no file back (only the heads file the report itself writes); the AnLLM and
    # Attention-Gate sections read the user's --anllm/--gate directories, which no section of the report writes
    suites = inspect.getsource(report.main).split("for name, path, how in")[0]
    reads = [ast.get_source_segment(suites, c) for c in ast.walk(ast.parse(textwrap.dedent(suites) + "\n    pass"))
             if isinstance(c, ast.Call) and (getattr(c.func, "id", None) == "_json"
                                             or getattr(c.func, "attr", None) in ("read_text", "read_bytes", "open"))]
    assert reads and all("heads" in r and "results" not in r for r in reads), reads


def test_identity_flags_read_as_keywords_from_python_and_back_as_flags():
    msg = "OUT holds results of another configuration (--seed: 0 -> 1; --data content: ['a'] -> ['b']); pass a new --out"
    py = driver.as_keywords(msg)
    assert py == "OUT holds results of another configuration (seed=: 0 -> 1; data= content: ['a'] -> ['b']); pass a new out="
    assert driver.as_flags(py, {"seed", "data", "out"}) == msg


def test_as_flags_writes_a_bare_keyword_as_the_flag_alone():
    msg = "vt does not fit; pass tasks= without vt, a longer lengths=, or a smaller max_new_tokens="
    assert driver.as_flags(msg, {"tasks", "lengths", "max_new_tokens"}) == (
        "vt does not fit; pass --tasks without vt, a longer --lengths, or a smaller --max-new-tokens")


def test_a_suite_drops_compiled_programs_between_batches_near_linuxs_limit_on_mapped_regions(monkeypatch, capsys):
    """XLA's CPU backend maps each kernel's code into regions of its own; the kvjax-small report compiled past
    vm.max_map_count (65,530) in its RULER section and died in LLVM ("Cannot allocate memory", then a segmentation
    fault). Past 85 % of the limit, a suite's loop drops jax's compiled programs between batches."""
    import jax
    import jax.numpy as jnp

    from kvjax import engine

    f = jax.jit(lambda x: x * 2)
    f(jnp.ones(3))
    monkeypatch.setattr(engine, "mapped_regions", lambda: (55_000, 65_530))  # under 85 %: kept
    assert not engine.release_programs_near_map_limit() and f._cache_size() == 1
    monkeypatch.setattr(engine, "mapped_regions", lambda: (56_000, 65_530))  # past it: dropped, said once
    monkeypatch.setattr(engine, "_released", False)
    assert engine.release_programs_near_map_limit() and f._cache_size() == 0
    assert "56,000 of the 65,530 memory regions" in capsys.readouterr().err
    monkeypatch.setattr(engine, "mapped_regions", lambda: None)  # a system that does not say (not Linux)
    assert not engine.release_programs_near_map_limit()

    seen = []
    monkeypatch.setattr(engine, "release_programs_near_map_limit", lambda: seen.append(len(log.records)))
    log = driver.InMemory()
    suite = driver.Suite("s", None, [1, 2, 3, 4, 5], str, lambda b: [{"id": str(c)} for c in b], None,
                         batches=lambda todo: (todo[i:i + 2] for i in range(0, len(todo), 2)))
    driver.fill(suite, log, progress=False)
    assert seen == [2, 4, 5]  # after each batch's records



def test_dropping_compiled_programs_frees_the_regions_they_mapped():
    """The region count the guard reads is the operating system's own, and `jax.clear_caches` gives the regions of
    dropped programs back (checked on this machine's kernel, not assumed)."""
    import jax
    import jax.numpy as jnp

    from kvjax import engine

    if engine.mapped_regions() is None:
        pytest.skip("this system does not report its mapped regions (not Linux)")
    before = engine.mapped_regions()[0]
    kept = []
    for i in range(40):  # distinct programs, each with kernels of its own
        g = jax.jit(lambda x, i=i: jnp.tanh(x * i + 1).sum() + jnp.sin(x).mean() * i)
        g(jnp.ones((8, 8))).block_until_ready()
        kept.append(g)
    grown = engine.mapped_regions()[0]
    assert grown > before + 40  # at least one region per program
    assert engine.release_programs_near_map_limit(share=0.0)  # the functions live on; their compiled programs go
    assert engine.mapped_regions()[0] < before + (grown - before) / 2
    assert all(g._cache_size() == 0 for g in kept)


def test_a_compiled_call_after_a_compile_looks_at_the_mapped_regions_and_drops_programs_past_the_share(monkeypatch):
    """The guard runs where programs pile up, not only between a suite's batches: the first compiled call after any
    compile (a load from the persistent cache included) counts the regions, and drops every program past the share;
    a call that compiled nothing since does not read /proc/self/maps again."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax import engine

    @engine.compiled()
    def double(model, x):
        return x * model["w"]

    looks = []
    regions = [(1_000, 65_530)]
    monkeypatch.setattr(engine, "mapped_regions", lambda: looks.append(1) or regions[0])
    model = {"w": jnp.float32(2.0)}
    other = jax.jit(lambda x: x + 1)
    other(jnp.ones(3))  # a compile outside kvjax
    double(model, jnp.ones(3))  # looks (under the share: kept), then compiles itself
    assert len(looks) == 1 and other._cache_size() == 1
    double(model, jnp.ones(3))  # its own compile is looked at on the next call ...
    double(model, jnp.ones(3))  # ... and nothing since: no look
    assert len(looks) == 2
    regions[0] = (60_000, 65_530)  # past 85 %
    other(jnp.ones(4))  # a new shape compiles
    np.testing.assert_array_equal(double(model, jnp.ones(3)), 2.0)  # looks, drops every program, recompiles
    assert len(looks) == 3 and other._cache_size() == 0

