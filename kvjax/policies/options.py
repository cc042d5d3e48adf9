"""A method is one file: its rules, its options and its registration. This module is what the file declares with.

    @register("snapkv", paper="Li et al. 2024", docs="policies/scored.md")
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class SnapKV(ScoredPolicy):
        kernel: int = option(7, help="pooling kernel over positions", type=odd_positive_int)

* `option(default, help=..., flag=..., type=..., choices=...)`: a dataclass field that is a command-line option too,
  declared once, on the field: its default, its help, its flag (`--kernel`, from the field's name unless given), the
  parser that checks its text (`kvjax.values`) and its choices.
* `register(name, ...)`: the method under its `--policy` name, with its paper, its docs page and how much it holds.
  On a class, the method builds that class from the options given (its fields' options, `--budget` where it has a
  budget); `register(name, build=..., options=...)` registers a builder (a method made of several classes, AdaKV on
  SnapKV's score), its parameters named as the options it takes, declared on the classes' fields or in `options`.

Everything else is derived from the registrations (`methods()`): the `--policy` choices and every policy flag of
every command line (`kvjax.experiments.common.add_policy_args`), the options a suite leaves out of its identity, the
budget-less methods, `make_policy`, and the methods tables of the README and of the docs (`methods_table`, checked by
`tests/test_methods.py`). A user's own method is named on a command line as `--policy my_module:MyRule`
(`kvjax.policies.registry.method`): its options come from its fields.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from kvjax.errors import InvalidInput

KEY = "kvjax.option"  # the field metadata key an `option` is stored under
NO_CONST = object()
WARNED = "other method past one chunk (warned)"  # a prompt compressor's chunked prefill: each chunk scored alone


@dataclasses.dataclass(frozen=True)
class Option:
    """A command-line option of the methods. `help` says what it does (the methods that take it and their defaults
    are added from the declarations); `flag` is `--<dest>` unless given; `type` parses and checks its text
    (`kvjax.values`); `const`: a flag that takes no value and sets this (argparse's store_const)."""

    help: str
    flag: str | None = None
    type: Callable[[str], Any] | None = None
    choices: tuple | None = None
    const: Any = NO_CONST
    dest: str | None = None  # the name a builder and argparse give it; from the flag unless given (--no-compensation)

    def named(self, name: str) -> Option:
        """This option as the field (or builder parameter) `name` declares it: its flag `--<name>` unless given, its
        dest from the flag unless given."""
        flag = self.flag or "--" + name.replace("_", "-")
        return dataclasses.replace(self, flag=flag, dest=self.dest or flag.removeprefix("--").replace("-", "_"))


def option(default: Any = dataclasses.MISSING, *, help: str, flag: str | None = None,
           type: Callable[[str], Any] | None = None, choices: tuple | None = None, const: Any = NO_CONST,
           dest: str | None = None, **field_kwargs) -> Any:
    """A dataclass field that is also a command-line option (`Option`), declared once: default, help, flag, parser,
    choices."""
    spec = Option(help=help, flag=flag, type=type, choices=tuple(choices) if choices else None, const=const,
                  dest=dest)
    return dataclasses.field(default=default, metadata={KEY: spec}, **field_kwargs)


def fixed(default: Any) -> Any:
    """A field that a base class declares as an option and this method fixes: no flag sets it here (TOVA scores by
    the last query only, so its `observation_window` is 1)."""
    return dataclasses.field(default=default, metadata={KEY: None})


def _spec(cls, name: str) -> Option | None:
    """The option declared on field `name` of `cls`, or of the base that declared it (a subclass that only changes
    its default, as MAT's anchor cache does for `prefill_mode`, keeps the declaration; one that `fixed` it has none)."""
    for base in cls.__mro__:
        if dataclasses.is_dataclass(base):
            for f in dataclasses.fields(base):
                if f.name == name and KEY in f.metadata:
                    return None if f.metadata[KEY] is None else f.metadata[KEY].named(name)
    return None


def field_options(cls) -> dict[str, tuple[Option, Any]]:
    """`{dest: (option, the field's default in cls)}` of a policy class's option fields (a field named otherwise
    than its flag is taken by its flag's dest: AdaKV's `alpha` is `--adakv-alpha`)."""
    out = {}
    for f in dataclasses.fields(cls):
        spec = _spec(cls, f.name)
        if spec is not None:
            out[spec.dest] = (spec, f.default if f.default is not dataclasses.MISSING else None)
    return out


def field_of(cls, dest: str) -> str:
    """The field of `cls` whose option's dest is `dest` (or the field named `dest`: a builder's internal value, the
    model's depth)."""
    for f in dataclasses.fields(cls):
        spec = _spec(cls, f.name)
        if spec is not None and spec.dest == dest:
            return f.name
    if dest in {f.name for f in dataclasses.fields(cls)}:
        return dest
    raise InvalidInput(f"{cls.__name__} has no option {dest!r}")


@dataclasses.dataclass(frozen=True)
class Method:
    """A registered method: `--policy name` builds `build(budget, **options)`; `options` are the command-line options
    it takes (`{dest: Option}`) and `defaults` theirs; `internal` the builder's parameters a suite gives rather than
    a user (the model's depth, KVzip's replay prompts)."""

    name: str
    build: Callable[..., Any]
    paper: str
    docs: str | None
    memory: str
    budget: bool
    options: Mapping[str, Option]
    defaults: Mapping[str, Any]
    internal: frozenset[str]
    source: str  # the file that declares it
    kvpress: str = "—"  # the kvpress press it matches (kvpress 0.5.5), as the parity tests build it
    chunked: str = ""  # what a prompt read in chunks (--prefill-mode chunked) does to it

    def __call__(self, budget=None, **options):
        return self.build(budget, **options)

    @property
    def parameters(self) -> frozenset[str]:
        """Every keyword `build` takes: the budget, the options, the internal values."""
        return frozenset({"budget", *self.options, *self.internal})


_METHODS: dict[str, Method] = {}
INTERNAL = frozenset({"num_layers", "replay"})


def _declared(classes) -> dict[str, tuple[Option, Any]]:
    out = {}
    for cls in classes:
        for dest, (spec, default) in field_options(cls).items():
            out.setdefault(dest, (spec, default))
    return out


def given(**options) -> dict[str, Any]:
    """The options given (not None): a builder passes only these, so every other takes its field's default."""
    return {k: v for k, v in options.items() if v is not None}


def class_builder(cls) -> Callable[..., Any]:
    """`build(budget, **options)` of a policy class: the options given (None: the field's own default), and the
    budget where the class has one (`ratio` replaces it: kvpress's compression ratio)."""
    names = {f.name for f in dataclasses.fields(cls)}

    def build(budget=None, **options):
        kw = {field_of(cls, dest): v for dest, v in options.items() if v is not None}
        if "budget" in names:  # the ratio replaces the token budget
            kw["budget"] = None if kw.get("ratio") is not None else budget
        return cls(**kw)

    return build


def register(name: str, *, paper: str, docs: str | None, memory: str = "real", budget: bool = True,
             build: Callable[..., Any] | None = None, classes: tuple = (),
             options: Mapping[str, Option] | None = None, kvpress: str = "—", chunked: str = "",
             defaults: Mapping[str, Any] | None = None):
    """Registers a method under its `--policy` name (see the module). With `build`, its parameters (but `budget`
    and `INTERNAL`) are the options it takes, each declared on a field of `classes` or in `options`; without,
    returns a class decorator. `defaults`: what the help says of an option whose default the builder decides
    (DuoAttention's sinks and window: the pattern's). A name registered twice is refused."""

    def add(builder, declared: dict[str, tuple[Option, Any]], source: str):
        if name in _METHODS and _METHODS[name].source != source:
            raise InvalidInput(f"--policy {name} is registered twice ({_METHODS[name].source}, {source})")
        params = [p for p in inspect.signature(builder).parameters if p != "budget"]
        wanted = [p for p in params if p not in INTERNAL and p != "options"]
        missing = [p for p in wanted if p not in declared]
        if missing:
            raise InvalidInput(f"--policy {name}: the builder's parameters {missing} are declared as no option")
        takes_all = "options" in params  # a class builder: every declared option
        dests = list(declared) if takes_all else wanted
        signature = inspect.signature(builder).parameters
        said = {d: signature[d].default if d in signature and signature[d].default is not inspect.Parameter.empty
                and signature[d].default is not None else declared[d][1] for d in dests}
        _METHODS[name] = Method(name, builder, paper, docs, memory, budget, {d: declared[d][0] for d in dests},
                                {**said, **(defaults or {})}, frozenset(p for p in params if p in INTERNAL), source,
                                kvpress, chunked)

    extra = {d: (spec.named(d), None) for d, spec in (options or {}).items()}
    if build is not None:
        add(build, {**_declared(classes), **extra}, _source(build))
        return build

    def decorate(cls):
        def build_cls(budget=None, **options):
            return class_builder(cls)(budget, **options)

        add(build_cls, {**_declared((cls, *classes)), **extra}, _source(cls))
        cls.registered_as = name
        return cls

    return decorate


def _source(obj) -> str:
    try:
        return inspect.getsourcefile(obj) or "?"
    except TypeError:
        return "?"


def methods() -> dict[str, Method]:
    """Every registered method, by `--policy` name (kvjax's own, once `kvjax.policies` is imported, and any
    registered since: importing this module imported `kvjax.policies`, whose modules register theirs)."""
    return dict(_METHODS)


def all_options() -> dict[str, tuple[Option, dict[str, Any]]]:
    """`{dest: (option, {method: its default})}` over every registered method: what the command lines offer. One
    dest is one option: its flag, parser and choices are the same wherever it is declared."""
    out: dict[str, tuple[Option, dict[str, Any]]] = {}
    for m in methods().values():
        for dest, spec in m.options.items():
            seen = out.setdefault(dest, (spec, {}))
            seen[1][m.name] = m.defaults[dest]
    return out


def no_budget() -> frozenset[str]:
    """The methods sized by their own options rather than --budget."""
    return frozenset(n for n, m in methods().items() if not m.budget)


class Live(AbstractSet):
    """A set computed when it is read (`no_budget`, the options' dests), so a method registered later is in it."""

    def __init__(self, compute: Callable[[], Any]):
        self.compute = compute

    @classmethod
    def _from_iterable(cls, it):  # what `set(...) - live` and `live | set(...)` build: a plain frozenset
        return frozenset(it)

    def __contains__(self, x) -> bool:
        return x in self.compute()

    def __iter__(self):
        return iter(self.compute())

    def __len__(self) -> int:
        return len(self.compute())


def _kvjax_own(m: Method) -> bool:
    return "/kvjax/policies/" in m.source.replace("\\", "/")  # a user's own method is not in kvjax's tables


def methods_table(docs_root: str = "") -> str:
    """The markdown table of kvjax's methods, one row per `--policy` name: its paper, the memory it holds, what a
    chunked prefill does to it, the kvpress press it matches and its docs page (links under `docs_root`).
    docs/policies/index.md holds it, checked by `tests/test_methods.py`."""
    lines = ["| `--policy` | paper | memory held | chunked prefill | kvpress | page |", "|---|---|---|---|---|---|"]
    for m in sorted(filter(_kvjax_own, methods().values()), key=lambda m: m.name):
        page = m.docs.removeprefix("policies/") if m.docs else ""
        link = f"[{page}]({docs_root}{page})" if page else ""
        lines.append(f"| `{m.name}` | {m.paper} | {m.memory} | {m.chunked} | {m.kvpress} | {link} |")
    return "\n".join(lines)


def pages_table(docs_root: str, title: Callable[[str], str]) -> str:
    """The README's methods table, one row per docs page (`title(page)` its heading): the `--policy` names it
    documents and the memory they hold."""
    pages: dict[str, list[Method]] = {}
    for m in sorted(filter(_kvjax_own, methods().values()), key=lambda m: m.name):
        pages.setdefault((m.docs or "").partition("#")[0], []).append(m)
    rows = []
    for page, ms in pages.items():
        names = ", ".join(f"`{m.name}`" for m in ms)
        usual = max((m.memory for m in ms), key=lambda x: ([m.memory for m in ms].count(x), -len(x)))  # others named
        memory = "; ".join([usual] + [f"`{m.name}`: {m.memory}" for m in ms if m.memory != usual])
        rows.append(f"| [{title(page)}]({docs_root}{page}) | {names} | {memory} |")
    lines = ["| method | `--policy` | memory held |", "|---|---|---|"] + sorted(rows)
    return "\n".join(lines)


__all__ = ["Live", "Method", "Option", "all_options", "class_builder", "field_options", "fixed", "given", "methods",
           "methods_table", "no_budget", "option", "pages_table", "register"]
