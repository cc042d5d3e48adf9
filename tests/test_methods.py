"""A method is one file (issue #83): its rule, its options and its registration. A new method written in one
module of a researcher's own, nothing else changed, runs through `kvjax.generate`, the command lines (with its own
options as flags), a suite (records and resume) and the methods index; and what kvjax derives from the
registrations (the README's and the docs' methods tables, every command line's policy flags) is what they say."""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap

import numpy as np
import pytest

from kvjax.experiments import cli, generate as generate_cli, methods as methods_cli, passkey
from kvjax.policies import FullCache, options

from .conftest import random_ids

# A researcher's own method, in one file: a rule (its score) and its option, registered under a --policy name.
OWN = '''
import dataclasses

import jax.numpy as jnp

from kvjax.policies.base import observation_window_option
from kvjax.policies.options import option, register
from kvjax.policies.scored import ScoredPolicy


@register("value-norm", paper="a test's own rule", docs=None)
@dataclasses.dataclass(frozen=True, kw_only=True)
class ValueNorm(ScoredPolicy):
    """Keeps the prompt tokens whose values have the largest (or smallest) L2 norm, per KV head."""

    observation_window: int = observation_window_option(0)
    order: str = option("largest", help="keep the values of largest or of smallest norm",
                        choices=("largest", "smallest"))

    def score(self, layer, k, v, pos, stats):
        norm = jnp.linalg.norm(v.astype(jnp.float32), axis=-1)
        return norm if self.order == "largest" else -norm
'''


@pytest.fixture
def own(tmp_path, monkeypatch):
    (tmp_path / "my_rules.py").write_text(textwrap.dedent(OWN))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rules", None)
    yield "my_rules:ValueNorm"
    sys.modules.pop("my_rules", None)
    for name, m in options.methods().items():  # the registry as kvjax ships it, for the tests after this one
        if m.source.startswith(str(tmp_path)):
            options._METHODS.pop(name)


def _top(values: np.ndarray, budget: int, largest: bool) -> list[int]:
    """The positions a value-norm rule keeps, by numpy: per position the norm of its value vector, the top `budget`."""
    norm = np.linalg.norm(values.astype(np.float64), axis=-1)
    order = np.argsort(-norm if largest else norm, kind="stable")
    return sorted(order[:budget].tolist())


@pytest.mark.parametrize("order", ["largest", "smallest"])
def test_an_own_method_in_one_module_runs_through_generate(own, tiny, order):
    """Through `kvjax.generate`: per layer and KV head, the prompt positions the new rule keeps are the top `budget`
    of its values' norms, taken by numpy from the full cache's values (an independent computation of the rule)."""
    from kvjax import generate
    from kvjax.cache import kept_sets

    import my_rules

    prompt = random_ids(40, 97, seed=7)
    budget = 12
    full = generate(tiny.model, [prompt], FullCache(), max_new_tokens=1)
    mine = generate(tiny.model, [prompt], my_rules.ValueNorm(budget=budget, order=order), max_new_tokens=1)
    assert int(mine.held_bytes[0]) < int(full.held_bytes[0])
    for layer, (fl, kept) in enumerate(zip(full.cache, kept_sets(mine.cache))):
        pos = np.asarray(fl.pos)[0]  # [kvh, C]: the full cache's position per slot
        for head, got in enumerate(kept):
            slots = [int(np.flatnonzero(pos[head] == p)[0]) for p in range(len(prompt))]
            want = _top(np.asarray(fl.v)[0, head, slots], budget, order == "largest")
            assert [p for p in got if p < len(prompt)] == want, (layer, head)


def test_an_own_method_on_the_command_line_with_its_options(own, tiny_dir, capsys):
    """`--policy my_rules:ValueNorm` imports the class; its field `order` is the flag `--order`, its choices checked
    (a bad one is one line naming the flag, exit 2); a flag no policy of the run takes is refused."""
    base = ["--model", str(tiny_dir), "--max-new-tokens", "2", "--budget", "12", "a b c d e f g h i j k l m n o p q r"]
    assert cli.run(generate_cli.main, [*base, "--policy", own, "--order", "smallest"]) == 0
    out = capsys.readouterr().out
    assert own in out or "value-norm" in out
    with pytest.raises(SystemExit) as bad:
        cli.run(generate_cli.main, [*base, "--policy", own, "--order", "middle"])
    assert bad.value.code == 2 and "--order" in capsys.readouterr().err
    assert cli.run(generate_cli.main, [*base, "--policy", "snapkv", "--order", "smallest"]) == 2
    assert "--order" in capsys.readouterr().err


def test_an_own_method_through_a_suite_with_records_and_resume(own, tiny_dir, tmp_path, capsys):
    """The passkey suite under the new method: its records carry the option given (part of the run's identity), and a
    second run of the same command resumes, reusing every record."""
    argv = ["--model", str(tiny_dir), "--lengths", "300", "--depths", "0.5", "--samples", "2", "--policy", own,
            "--budget", "64", "--order", "smallest", "--out", str(tmp_path / "pk")]
    assert cli.run(passkey.main, argv) == 0
    records = [json.loads(line) for line in (tmp_path / "pk" / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 2
    assert all("smallest" in json.dumps(r) for r in records)
    capsys.readouterr()
    assert cli.run(passkey.main, argv) == 0
    assert "2 records of this identity reused, 0 to compute" in capsys.readouterr().err
    assert (tmp_path / "pk" / "samples.jsonl").read_text().count("\n") == 2


def test_an_own_method_in_the_methods_index(own, capsys):
    assert methods_cli.main(["--import", "my_rules"]) == 0
    assert "value-norm" in capsys.readouterr().out
    assert methods_cli.main(["--policy", own]) == 0
    card = capsys.readouterr().out
    assert "--order (default largest): keep the values of largest or of smallest norm" in card
    assert "value-norm" not in options.methods_table()  # kvjax's tables list kvjax's methods
    assert [n for n, m in options.methods().items() if m.source.endswith("my_rules.py")] == ["value-norm"]


def test_the_methods_tables_are_the_registrations():
    """README.md's and docs/policies/index.md's methods tables are what the registrations generate (regenerate with
    `python -m kvjax.experiments.methods --write`), and every method's docs page and section exist."""
    for path, table in methods_cli.tables().items():
        text = path.read_text()
        assert methods_cli.replace_block(text, table, path) == text, f"{path}: run python -m kvjax.experiments.methods --write"
    for m in options.methods().values():
        page, _, anchor = m.docs.partition("#")
        headings = [line.lstrip("#").strip().lower().replace(" ", "-")
                    for line in (methods_cli.ROOT / "docs" / page).read_text().splitlines() if line.startswith("#")]
        assert not anchor or anchor in headings, (m.name, m.docs)


def test_every_policy_flag_is_declared_once():
    """A flag is one option wherever it is declared: the same parser, choices and help for every method taking it;
    and every option a method takes is a flag of the command lines (`add_policy_args`)."""
    import argparse

    from kvjax.experiments.common import add_policy_args

    seen: dict[str, options.Option] = {}
    for m in options.methods().values():
        for dest, spec in m.options.items():
            assert seen.setdefault(dest, spec) == spec, (m.name, dest)
    p = argparse.ArgumentParser()
    add_policy_args(p)
    flags = {s for a in p._actions for s in a.option_strings}
    assert {spec.flag for spec in seen.values()} <= flags


def test_a_method_registered_twice_is_refused(own):
    import my_rules

    from kvjax.errors import InvalidInput

    with pytest.raises(InvalidInput, match="value-norm"):
        options.register("value-norm", paper="", docs=None)(
            dataclasses.make_dataclass("Other", [], bases=(my_rules.ValueNorm,), frozen=True))


def test_a_subclass_of_a_registered_method_is_its_own(tmp_path, monkeypatch):
    """`--policy mod:Sub` for a subclass of a registered class builds the subclass (its own method, its own name),
    never the registered base; a class of one's own sized by its own fields is refused --budget in one line."""
    from kvjax.errors import InvalidInput
    from kvjax.policies import make_policy

    (tmp_path / "my_subs.py").write_text(textwrap.dedent('''
        import dataclasses
        from kvjax.policies import FullCache, SnapKV

        @dataclasses.dataclass(frozen=True, kw_only=True)
        class MySnap(SnapKV):
            pass

        @dataclasses.dataclass(frozen=True, kw_only=True)
        class MyFull(FullCache):
            pass
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert type(make_policy("my_subs:MySnap", 64)).__name__ == "MySnap"
        assert type(make_policy("my_subs:MyFull")).__name__ == "MyFull"
        assert cli.run(generate_cli.main, ["--policy", "my_subs:MyFull", "--budget", "64", "a b c"]) == 2
        with pytest.raises(InvalidInput, match="does not take"):
            make_policy("tova", 64, observation_window=16)  # TOVA's window is its last query: no option
    finally:
        sys.modules.pop("my_subs", None)
        for name in [n for n in options.methods() if n.startswith("my_subs:")]:
            options._METHODS.pop(name)


def test_a_method_with_its_own_hook_is_not_a_silent_member():
    """A combinator or a quantized cache runs only its own policy's `after_prompt`: a member with a hook of its own
    (KVzip's replay) is refused by name instead of keeping every token."""
    from kvjax.errors import InvalidInput
    from kvjax.policies import KVzip, Quantized, StreamingLLM, by_head, by_layer
    from kvjax.policies.ring import FullCache as Full

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Hooked(Full):
        def after_prompt(self, run):
            return run.plan, run.cache

    zip_ = KVzip(ratio=0.5, repeat_ids=(1,), continue_ids=(2,), suffix_ids=(3,))
    with pytest.raises(InvalidInput, match="ByLayer: KVzip runs a hook after its prompt"):
        by_layer(StreamingLLM(budget=16), zip_, split=1)
    with pytest.raises(InvalidInput, match="Hooked runs a hook after its prompt"):
        by_head([[True, False]], Full(), Hooked()).check(1, 2)
    with pytest.raises(InvalidInput, match="quantized cache .*Hooked|Hooked.*quantized"):
        Quantized(Hooked(), bits=8)
