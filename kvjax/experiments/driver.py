"""One driver for every suite: resolve the model and the policies, claim OUT's identity, keep the
records, loop, report.

Each suite is a typed function, `suite(lm, policies, out, **options) -> SuiteResult`, called the same
way by its command line (`main(argv)` parses flags, loads the model, and calls `suite`) and by
`kvjax.experiments.report`, which gets the tables and numbers back as a `SuiteResult` instead of reading
JSON files. Called from Python, an error names the keyword argument (`lengths=[9]`); from the
command line, the flag (`--lengths 9`).

    from kvjax.experiments import driver, passkey
    lm = driver.load_model("kvjax/models/small")
    result = passkey.suite(lm, driver.resolve_policies("full,streaming", budget=256), "results/pk")
    result.summary["streaming"]          # {"length": {"depth": accuracy}}, keys as JSON writes them

A suite declares a `Suite` (its cells, a cell's record id, how a batch of cells runs, how the records
become tables and plots) and hands it to `run_suite`, which does the steps every suite shares: `claim`
(the identity of OUT is the model as loaded plus the suite's options that change a result, so a
rerun resumes and another configuration is refused), `fill` (the cells not yet recorded, with
progress) and `finish` (the tables, written atomically, returned typed).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any


from kvjax.experiments.records import (
    ResultLog,
    claim_results_dir,
    dumps_finite,
    options_of,
    write_atomic,
)
from kvjax import engine
from kvjax.progress import bar as progress_bar
from kvjax.errors import InvalidInput
from kvjax.policies import NO_BUDGET, REGISTRY, Policy, make_policy

__all__ = [
    "ArgumentError", "InMemory", "Suite", "SuiteResult", "as_flags", "as_keywords", "attach_gates", "batches",
    "build_policy", "call", "check_names", "check_replay", "claim", "fill", "finish", "kvzip_replay", "labelled", "labels",
    "load_model", "open_records", "policy_options", "positive", "resolve_policies", "run_suite", "width_label",
]


class ArgumentError(InvalidInput):
    """A suite's argument is invalid, or (`usage=False`) does not fit the data or the model. The
    message names keywords (`lengths=[9]`; a bare `tasks=` names the option itself); from the
    command line they read as flags (`call`)."""

    def __init__(self, message: str, *, usage: bool = True):
        super().__init__(message)
        self.usage = usage


def call(parser: argparse.ArgumentParser, suite, *args, flag_names: Mapping[str, str] | None = None,
         **kwargs) -> SuiteResult:
    """`suite(*args, **kwargs)` from a command line, each keyword of an `ArgumentError` written as the
    flag the user typed: a usage error ends as `parser`'s (exit 2 after the usage line, as argparse's
    own), any other as one `error:` line (`kvjax.experiments.cli`). `flag_names` maps a keyword to the option
    that sets it where the two differ (the report's `tasks=` is its `--ruler-tasks`)."""
    try:
        return suite(*args, **kwargs)
    except ArgumentError as err:
        message = as_flags(str(err), {a.dest for a in parser._actions}, flag_names)
        if err.usage:
            parser.error(message)
        raise ArgumentError(message, usage=False) from None  # an InvalidInput: one line at the command line


def builtin_task(data: str | None, defaults: Mapping[str, Any], **given: Any) -> dict[str, Any]:
    """The options that shape a built-in task (`given`, None where the user gave none). Items from `data`
    bring their own, so there a given one would be silently ignored: it is refused, and the options are
    None (the run's identity says the task did not use them). Without `data`, each missing one takes its
    default from `defaults`."""
    if data:
        ignored = [f"{k}={v}" for k, v in given.items() if v is not None]
        if ignored:
            raise ArgumentError(f"{' '.join(ignored)} {'shapes' if len(ignored) == 1 else 'shape'} the built-in task; "
                                f"data={data} brings its own items")
        return dict.fromkeys(given)
    return {k: defaults[k] if v is None else v for k, v in given.items()}


def as_flags(message: str, dests: Iterable[str], rename: Mapping[str, str] | None = None) -> str:
    """`lengths=[9] + new=8` -> `--lengths [9] + --new 8`, and a bare `tasks=` -> `--tasks`, for the
    names in `dests` (a parser's options); every other `name=` stays. `rename` maps a keyword to the
    option that sets it where the names differ (a policy's `every=` is `--recompress-every`)."""
    rename, dests = dict(rename or {}), set(dests)

    def flag(m: re.Match) -> str:
        name = rename.get(m.group(1), m.group(1))
        if name not in dests:
            return m.group(0)
        return f"--{name.replace('_', '-')}" + ("" if m.group(2) is not None else " ")

    return re.sub(r"\b([a-z_]+)=((?=[\s,;:.)]|$))?", flag, message)


@dataclasses.dataclass(frozen=True)
class SuiteResult:
    """What a suite run returns: its markdown table (OUT/results.md), its numbers (OUT/results.json),
    the figures it drew and each policy label's full description."""

    suite: str
    out: Path
    table: str
    summary: Mapping[str, Any]
    policies: Mapping[str, str]
    figures: tuple[Path, ...] = ()


def load_model(path=None, *, dtype: str = "float32", attention_impl: str = "xla", allow_nonfinite: bool = False,
               gate_params: str | None = None, tokenizer: bool = True):
    """The model a suite runs on, with its tokenizer (`path=None`: the embedded default model; a
    directory without one is an error unless `tokenizer=False`), and Attention-Gate parameters
    attached when `gate_params` names a directory from `kvjax.experiments.train_gate`. How it was loaded is recorded on it (`lm.load_options`) and is part of
    every results directory's identity."""
    from kvjax.experiments.default_model import DEFAULT_MODEL_DIR, default_model_dir
    from kvjax.models import load

    if path is None:
        path, random_weights = default_model_dir()
        if random_weights:
            print(f"NOTE: RANDOM WEIGHTS - {DEFAULT_MODEL_DIR} is missing, so the default model is a tiny "
                  f"randomly initialised Llama ({path}); its results mean nothing.")
    lm = load(path, dtype=dtype, attention_impl=attention_impl, allow_nonfinite=allow_nonfinite)
    if tokenizer and lm.tokenizer is None:
        raise InvalidInput(f"{path} has no tokenizer files")
    if gate_params is not None:
        attach_gates(lm, gate_params)
    return lm


def attach_gates(lm, gate_params: str) -> None:
    """Loads the gates in `gate_params` into `lm.model`; they change what the gate policy keeps, so
    the directory (and its content) joins the identity of every result computed with them."""
    from kvjax.gate import load_gates

    load_gates(lm.model, gate_params)
    lm.load_options["gate_params"] = str(gate_params)


def policy_options(names: Sequence[str], options: Mapping[str, Any]) -> tuple[list[dict], set[str]]:
    """Each policy's share of `options` (those its constructor takes), and the options none takes."""
    params = [REGISTRY[n].parameters for n in names]
    given = {k: v for k, v in options.items() if v is not None}
    return [{k: v for k, v in given.items() if k in ps} for ps in params], set(given) - {k for ps in params for k in ps}


def check_names(names: Sequence[str]) -> None:
    """An error naming the first of `names` that is no registered policy."""
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise InvalidInput(f"unknown policy {unknown[0]!r}; available: {sorted(REGISTRY)}")


def labels(names: Sequence[str]) -> list[str]:
    """Each name as the label of its policy; a name given twice is labelled name#i (its position)."""
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


def build_policy(name: str, budget: int | None, options: Mapping[str, Any], *, num_layers: int | None = None,
                 model_dir=None, chat: bool = False) -> Policy:
    """Policy `name` with `options` (its share, `policy_options`) and `budget` if it takes one;
    `num_layers` goes to the policies that need the depth (PyramidKV) and KVzip replays the prompts of
    the tokenizer at `model_dir` (`kvzip_replay`; `chat`: for prompts in its chat template)."""
    params, kw = REGISTRY[name].parameters, dict(options)
    if num_layers is not None and "num_layers" in params:
        kw["num_layers"] = num_layers
    if "replay" in params and model_dir is not None:
        kw["replay"] = kvzip_replay(model_dir, chat)
    return make_policy(name, None if name in NO_BUDGET else budget, **kw)


def kvzip_replay(model_dir, chat: bool = False) -> dict | None:
    """KVzip's replay prompts from the tokenizer at `model_dir` (a directory or a GGUF file); None without one.
    `chat`: the suite's prompts are in the tokenizer's chat template (--chat-template on), so the replay is too
    (the template's assistant header ends it, and the user turn's opening is its prefix, as kvpress); otherwise
    raw text: "\\n" ends its prompt."""
    from kvjax.kvzip import replay_prompts
    from kvjax.models.loading import tokenizer_at

    tok = None if model_dir is None else tokenizer_at(Path(model_dir))
    return None if tok is None else replay_prompts(tok, chat=chat)


def check_replay(policies: Mapping[str, Policy], model_dir, chat: bool) -> None:
    """An error naming each KVzip-family policy of `policies` whose replay prompts are not those of the prompt
    format (`kvzip_replay(model_dir, chat)`): a replay in raw text over a context in the chat template (or the
    reverse) is not kvpress's KVzip."""
    family = {lab: p for lab, p in policies.items() if hasattr(p, "suffix_ids")}
    want = kvzip_replay(model_dir, chat) if family and model_dir is not None else None
    if want is None:
        return
    wrong = [lab for lab, p in family.items()
             if (tuple(p.suffix_ids), p.prefix) != (tuple(want["suffix_ids"]), want["prefix"])]
    if wrong:
        raise ArgumentError(f"{', '.join(wrong)}: KVzip's replay prompts are not those of chat_template="
                            f"{'on' if chat else 'off'}; build them with driver.resolve_policies(..., chat={chat}) "
                            f"(or replay=driver.kvzip_replay(model, chat={chat}))", usage=False)


def resolve_policies(names: str | Sequence[str], *, budget: int | None = None, num_layers: int | None = None,
                     model_dir=None, chat: bool = False, **options) -> dict[str, Policy]:
    """`{label: policy}` for `names` ("full,streaming" or a list), each given the keyword `options` its
    constructor takes and `budget` if it takes one: the Python form of `--compare`. An option that
    no policy takes, or a budget none takes, is an error naming the keyword; a name given twice is
    labelled name#i. `num_layers` goes to the policies that need the depth (PyramidKV); KVzip replays
    the prompts of `model_dir`'s tokenizer (`chat`: in its chat template, for a suite run with it on)."""
    names = names.split(",") if isinstance(names, str) else list(names)
    check_names(names)
    if budget is not None and all(n in NO_BUDGET for n in names):
        raise InvalidInput(f"budget={budget}: no policy of {','.join(names)} takes a budget")
    per_policy, unused = policy_options(names, options)
    if unused:
        raise InvalidInput(f"{', '.join(f'{k}=' for k in sorted(unused))}: no policy of {','.join(names)} takes it")
    return {lab: build_policy(n, budget, kw, num_layers=num_layers, model_dir=model_dir, chat=chat)
            for lab, n, kw in zip(labels(names), names, per_policy)}


def positive(value, name: str, *, optional: bool = False) -> None:
    """A count argument of a suite: a positive int (or None where `optional`), else an `ArgumentError`
    naming it (a negative count once sliced rows away: `rows[:-1]`)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentError(f"{name}={value!r} must be a positive integer")


def labelled(policies: Mapping[str, Policy] | Sequence[Policy] | Policy) -> dict[str, Policy]:
    """`{label: policy}`: a mapping's labels naming each quantized cache's width (`width_label`), or a policy (or
    list) labelled by its description (which names the width)."""
    if isinstance(policies, Policy):
        policies = [policies]
    if isinstance(policies, Mapping):
        return {width_label(label, p): p for label, p in policies.items()}
    return {p.describe(): p for p in policies}


def width_label(label: str, policy: Policy) -> str:
    """`label` with the width of a quantized cache (`full (2-bit KV)`): every table, plot legend and record
    label of a quantized run says so, so that it never reads as the full-precision cache of the same name."""
    spec = getattr(policy, "kv_quant", None)  # `kvjax.policies.Quantized`'s
    if spec is None:
        return label
    tag = f"({spec.bits}-bit KV)"
    return label if label.endswith(tag) else f"{label} {tag}"


def claim(out: str | Path, lm, options: Mapping[str, Any], *, files: Iterable[str] = (),
          selection: Iterable[str] = (), extra: Mapping[str, Any] | None = None) -> Path:
    """Claims `out` for this configuration: a rerun with the same identity resumes, another is
    refused naming each difference.

    The identity is the model as loaded (`lm.load_options`: dtype, attention, gates, ...) and the
    suite's `options` that change a result, spelled as their flags so that the command line and
    Python calls share a directory. `files` name options whose content counts; `selection` options
    that only choose which records are computed (each record's key names its coordinates), so a
    rerun asking for more of them resumes. `extra` entries join the identity as named (e.g. the
    fingerprint of a harness's config). Policies are not here: records are keyed by each policy's
    full description."""
    out = Path(out)
    load = {"gate_params": None, **getattr(lm, "load_options", {})}
    try:
        claim_results_dir(out, lm, options_of({**load, **options}, policy_keyed=False, files={*files, "gate_params"},
                                              selection=selection) | dict(extra or {}))
    except InvalidInput as err:  # a refusal names options as the identity file spells them: `--seed`, `--out`
        raise ArgumentError(as_keywords(str(err)), usage=False) from None
    out.mkdir(parents=True, exist_ok=True)
    return out


def as_keywords(message: str) -> str:
    """`--seed: 0 -> 1; pass a new --out` -> `seed=: 0 -> 1; pass a new out=`: the identity's flags as the
    keywords a Python caller wrote (`call` turns them back into flags for the command line)."""
    return re.sub(r"(?<![\w-])--([a-z][a-z-]*)", lambda m: m.group(1).replace("-", "_") + "=", message)


def open_records(out: str | Path, lm, log: str, options: Mapping[str, Any], *, key: str = "id", **identity
                 ) -> ResultLog:
    """`claim(out, lm, options, **identity)`, then the records of `out/log` keyed by `key` (resumable)."""
    return ResultLog(claim(out, lm, options, **identity) / log, key=key)


@dataclasses.dataclass(frozen=True)
class Suite:
    """What a suite declares; `run_suite` does the rest (identity, locking, resume, progress, tables).

    `cells` are every cell of the run in order (or a function giving them, called once OUT is claimed:
    cells whose making writes into OUT, as RULER's samples), `record_id(cell)` the key of its record in
    OUT/`log`; `batches(todo)` groups the cells not yet recorded into the calls of `run`, each returning
    the records of its cells (in the order they are kept); `report(log)` turns the records into
    (markdown, JSON summary, figures). Cells sharing a record id are computed once. `log=None`: the suite
    keeps its records itself (LongBench's predictions per policy and dataset), so every cell runs and its
    record is kept in memory for `report`."""

    name: str
    log: str | None
    cells: Sequence[Any] | Callable[[], Sequence[Any]]
    record_id: Callable[[Any], str]
    run: Callable[[list], Iterable[dict]]
    report: Callable[[ResultLog], tuple[str, Mapping[str, Any], Sequence[Path]]]
    batches: Callable[[list], Iterable[list]] = lambda todo: ([c] for c in todo)


def run_suite(suite: Suite, out: str | Path, lm, options: Mapping[str, Any],
              policies: Mapping[str, Policy | str] | Callable[[], Mapping[str, Policy | str]], *,
              progress: bool = True, **identity) -> SuiteResult:
    """Claims `out` (`claim`: this configuration's, locked; `identity` as `claim`'s keywords), runs the
    cells of `suite` without a record in OUT/`suite.log` with a progress bar, and writes its tables
    (`finish`). `policies` may be a function giving them once the cells are made (RULER's labels, which
    depend on each cell's prompt room)."""
    if suite.log is None:
        claim(out, lm, options, **identity)
        log = InMemory()
    else:
        log = open_records(out, lm, suite.log, options, **identity)
    fill(suite, log, progress)
    table, summary, figures = suite.report(log)
    return finish(suite.name, out, table, summary, policies() if callable(policies) else policies, figures)


class InMemory:
    """The records of a suite that keeps its own on disk (`Suite.log` None), keyed by "id"."""

    def __init__(self):
        self.records: dict[str, dict] = {}

    def __contains__(self, key) -> bool:
        return False  # the suite resumes itself: every cell runs

    def __iter__(self) -> Iterator[dict]:
        return iter(self.records.values())

    def add(self, record: dict) -> None:
        self.records[str(record["id"])] = record


def fill(suite: Suite, log: ResultLog | InMemory, progress: bool = True) -> None:
    """Adds to `log` the record of each cell of `suite` it lacks, with a progress bar over them."""
    todo, ids, reused = [], set(), set()
    for c in suite.cells() if callable(suite.cells) else suite.cells:
        rid = suite.record_id(c)
        if rid in log:
            reused.add(rid)
        elif rid not in ids:
            todo.append(c)
            ids.add(rid)
    if reused and progress:  # a rerun of the same identity: say what it reuses, never silently
        print(f"{suite.name}: resuming {Path(log.path).parent}: {len(reused)} records of this identity reused, "
              f"{len(todo)} to compute", file=sys.stderr)
    with progress_bar(total=len(todo), desc=suite.name, disable=not progress) as bar:
        for batch in suite.batches(todo):
            for record in suite.run(batch):
                log.add(record)
                bar.update(1)
            engine.release_programs_near_map_limit()  # a long suite compiles past Linux's limit on mapped regions


def batches(todo: Sequence, size: int, group: Callable[[Any], Any] = lambda c: None,
            unit: Callable[[Any], Any] = lambda c: c) -> Iterator[list]:
    """`todo` in runs of consecutive cells of one `group(c)`, each run cut so that a batch holds at most
    `size` distinct `unit(c)` (a prompt that several policies' cells share counts once)."""
    batch, units, key = [], [], None
    for c in todo:
        if batch and (group(c) != key or (unit(c) not in units and len(units) == size)):
            yield batch
            batch, units = [], []
        key = group(c)
        if unit(c) not in units:
            units.append(unit(c))
        batch.append(c)
    if batch:
        yield batch


def finish(suite: str, out: str | Path, table: str, summary: Mapping[str, Any], policies: Mapping[str, Policy | str],
           figures: Iterable[Path] = ()) -> SuiteResult:
    """Writes OUT/results.md and OUT/results.json (atomically; a non-finite number is an error) and
    returns them typed."""
    from kvjax.policies import reduces_to

    out = Path(out)
    # a policy whose parameters make it another method is marked in its table (and the summary)
    same = {lab: reduces_to(p) for lab, p in policies.items() if not isinstance(p, str) and reduces_to(p)}
    if same:
        table = table.rstrip("\n") + "\n\n" + "\n".join(f"**Note:** `{lab}` is {why}." for lab, why in same.items())
        summary = {**summary, "same_as": same}
    write_atomic(out / "results.md", table if table.endswith("\n") else table + "\n")
    write_atomic(out / "results.json", dumps_finite(dict(summary)))
    described = {lab: p if isinstance(p, str) else p.describe() for lab, p in policies.items()}
    return SuiteResult(suite, out, table, summary, described, tuple(Path(f) for f in figures))
