"""Shared command-line pieces: model resolution and --policy options for every experiment."""

from __future__ import annotations

import argparse
import sys
import math
from pathlib import Path

import numpy as np

from kvjax.experiments import driver
from kvjax.experiments.default_model import (  # noqa: F401
    DEFAULT_MODEL_DIR,
    RANDOM_DEFAULT_DIR,
    default_model_dir,
)
from kvjax.experiments.policy_options import POLICY_OPTIONS
from kvjax.cli import add_compile_cache_flag, model_help  # noqa: F401  (every suite's --model help)
from kvjax.errors import InvalidInput, MissingFile
from kvjax.policies import (
    NO_BUDGET,
    REGISTRY,
    Policy,
    Quantized,
    Decoding,
    recompress,
)
from kvjax.policies.scored import ScoredPolicy
from kvjax.values import (  # noqa: F401  (re-exported: the option types every suite's flags use)
    _number,
    finite_float,
    float_list,
    fraction_removed,
    int_list,
    nonnegative_float,
    nonnegative_int,
    odd_positive_int,
    positive_float,
    positive_int,
    probability,
)


def flag_given(args: argparse.Namespace, dest: str) -> str:
    """The command-line flag of option `dest` (`anchor_slots` -> `--anchor-slots`)."""
    del args
    return "--" + dest.replace("_", "-")


def utf8_text(text: str) -> str:
    """Text given on the command line. A shell in another encoding (Latin-1) hands Python bytes that are not UTF-8,
    which it keeps as lone surrogates that no tokenizer reads (a TypeError deep in it): refused here, naming the
    byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raw = text.encode("utf-8", "surrogateescape")
        byte = text[err.start].encode("utf-8", "surrogateescape")[0]
        raise argparse.ArgumentTypeError(f"{raw!r} is not UTF-8 (byte 0x{byte:02x} at character {err.start}); "
                                         "set a UTF-8 locale (LANG=C.UTF-8) or convert the text") from None
    return text


PROTOCOLS = ("aware", "agnostic")


def add_protocol_arg(p: argparse.ArgumentParser, default: str = "aware") -> None:
    """--protocol: compress the context with its question (aware) or without it (agnostic, kvpress's default)."""
    p.add_argument("--protocol", choices=PROTOCOLS, default=default,
                   help="aware: compress context and question together; agnostic: compress the context alone, "
                        "then extend the compressed cache with the question (kvpress's protocol)")


def split_question(prompts: list[list[int]], question_lengths: list[int], protocol: str
                   ) -> tuple[list[list[int]], list[list[int]] | None]:
    """`generate`'s (prompts, questions) for a protocol: the same token ids either way, the last
    `question_lengths[i]` of prompt i being its question."""
    if protocol == "aware":
        return prompts, None
    return [p[: len(p) - n] for p, n in zip(prompts, question_lengths)], [p[len(p) - n:] for p, n in
                                                                          zip(prompts, question_lengths)]


CHAT_TEMPLATE_MODES = ("auto", "on", "off")


def add_chat_template_arg(p: argparse.ArgumentParser, default: str = "auto", help: str | None = None) -> None:
    """--chat-template auto|on|off: the model's prompt format, for every suite that builds prompts."""
    p.add_argument("--chat-template", choices=CHAT_TEMPLATE_MODES, default=default,
                   help=help or "wrap each context in the tokenizer's chat template as kvpress's pipeline does (context "
                                "in the user turn; question, end of turn, assistant header, answer prefix after it): "
                                "on, off (raw text), or auto (on iff the tokenizer has a template, as kvpress). "
                                f"Default {default}")


def hint_raw(tok, on: bool, suite: str) -> None:
    """One line on stderr where a suite reads raw text with a model whose tokenizer has a chat template (an instruct
    model, which may answer nothing to raw text): what --chat-template does."""
    if not on and getattr(tok, "chat_template", None) is not None:
        print(f"note: {suite} reads raw text (the papers' protocol) and this tokenizer has a chat template; "
              "--chat-template auto (or on) wraps each prompt in it", file=sys.stderr)


def chat_template_on(tok, mode: str) -> bool:
    """`mode` ("auto" / "on" / "off") resolved for tokenizer `tok`: auto is on iff `tok.chat_template` is not None
    (kvpress's rule); "on" for a tokenizer without a template is an `InvalidInput`."""
    if mode not in CHAT_TEMPLATE_MODES:
        raise InvalidInput(f"chat_template={mode!r} is not one of {', '.join(CHAT_TEMPLATE_MODES)}")
    has = getattr(tok, "chat_template", None) is not None
    if mode == "on" and not has:
        raise InvalidInput("--chat-template on: the model's tokenizer has no chat template; pass --chat-template off "
                           "or auto")
    on = has if mode == "auto" else mode == "on"
    if on:
        chat_parts(tok, True)  # a template that cannot be applied is refused now, not hours into a run
    return on


def chat_template_mode(tok, mode: str) -> str:
    """--chat-template resolved for `tok`, "on" or "off" (what a run's identity and tables record); "on" without a
    template is an `InvalidInput` (one `error:` line, exit 2)."""
    return "on" if chat_template_on(tok, mode) else "off"


def chat_parts(tok, on: bool, *, enable_thinking: bool = False) -> tuple[str, str]:
    """(text before the context, text between the question and the answer prefix), as kvpress's
    `KVPressTextGenerationPipeline.preprocess` makes them: with the template, the user turn's opening and the end of
    the turn + the assistant header (the template applied to the context + a separator, split there); without,
    the BOS token's text and "\n"."""
    if not on:
        return getattr(tok, "bos_token", None) or "", "\n"
    context = "kvjax chat template probe"
    head, suffix = templated(tok, context, enable_thinking=enable_thinking)
    return head[: len(head) - len(context)], suffix


def templated(tok, context: str, *, enable_thinking: bool = False) -> tuple[str, str]:
    """The tokenizer's chat template applied to one user turn, `context` + a separator, with the assistant header:
    (the text up to the separator, the text after it), as kvpress splits it. A template that does not parse or
    fails, or that renders the turn without its content (or twice), is an `InvalidInput` naming it."""
    from jinja2 import TemplateError

    separator = "#" * (len(context) + 10)
    try:
        text = tok.apply_chat_template([{"role": "user", "content": context + separator}], add_generation_prompt=True,
                                       tokenize=False, enable_thinking=enable_thinking)
    except (TemplateError, ValueError, TypeError) as err:
        raise InvalidInput(f"the tokenizer's chat template cannot be applied ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''}); fix chat_template in its "
                           "tokenizer_config.json, or pass --chat-template off") from None
    if not isinstance(text, str) or text.count(separator) != 1:
        raise InvalidInput("the tokenizer's chat template renders a user turn without its content (or more than "
                           "once), so the context cannot be placed in it; fix chat_template in its "
                           "tokenizer_config.json, or pass --chat-template off")
    head, tail = text.split(separator)
    return head, tail


def prompt_ids(tok, context: str, question: str, answer_prefix: str = "", *, on: bool) -> tuple[list[int], list[int]]:
    """(context ids, question ids) of one prompt as kvpress's pipeline builds them (`preprocess`): with the template
    (`on`), the chat template around the context (the user turn's opening, then the context) and the question + the
    end of the turn + the assistant header + `answer_prefix`; without, BOS + context and question + "\n" +
    `answer_prefix`. Each part is tokenized alone, without special tokens (the BOS is text in the context). The
    question-agnostic protocol compresses the first and appends the second; the aware one reads both together."""
    head, suffix = chat_parts(tok, on)
    if on:  # kvpress applies the template to the context itself: the split is the template's
        ctx, suffix = templated(tok, context)
    else:
        ctx = head + context
    return (tok.encode(ctx, add_special_tokens=False),
            tok.encode(question + suffix + answer_prefix, add_special_tokens=False))


def add_run_args(p: argparse.ArgumentParser) -> None:
    """--allow-nonfinite, --debug and --no-compile-cache, for every command that loads a model."""
    g = p.add_argument_group("run")
    g.add_argument("--allow-nonfinite", action="store_true",
                   help="load a checkpoint even if a weight holds NaN or inf (results are still checked)")
    g.add_argument("--debug", action="store_true",
                   help="show the Python traceback of an error (also KVJAX_DEBUG=1)")
    add_compile_cache_flag(g)


def add_policy_args(p: argparse.ArgumentParser, default: str | None = "streaming", budget: int = 256) -> None:
    """--policy, --budget and every option of every method, each flag made from its declaration on the method's
    field (`kvjax.policies.options`): what it does, its parser and choices, and each method's default. A user's
    own method (`--policy my_module:MyRule`) brings its fields' options when the command line names it."""
    g = p.add_argument_group("cache policy")
    g.add_argument("--policy", default=default,
                   help=f"cache policy: one of {', '.join(sorted(REGISTRY))}, or a class of your own as "
                        "module:Class (a kvjax.policies.LayerPolicy; its options are its fields')")
    g.add_argument("--budget", type=positive_int,
                   help=f"cache slots per layer and KV head (MAT's c); default {budget} for the policies "
                        f"that take a budget ({', '.join(sorted(set(REGISTRY) - NO_BUDGET))})")
    for dest, (spec, defaults) in policy_option_specs().items():
        add_option(g, dest, spec, defaults)
    _own_methods_on_parse(p, g)
    g.add_argument("--gate-params", help="Attention-Gate: directory written by python -m kvjax.experiments.train_gate")
    g.add_argument("--recompress-every", type=positive_int,
                   help="prompt compressors (snapkv, slimkv, ...): re-score the cache every N generated tokens and "
                        "evict back to the budget (as kvpress's PrefillDecodingPress with both targets at the budget); the cache holds budget + N slots")
    q = p.add_argument_group("quantized cache (kvjax.quant): every policy's kept slots stored as codes")
    q.add_argument("--kv-bits", type=int, choices=[8, 4, 2],
                   help="8: int8, one scale per token; 4 or 2: KIVI (keys per channel, values per token)")
    q.add_argument("--kv-group", type=positive_int, help="KIVI's group size G (4 and 2 bits); default 32")
    q.add_argument("--kv-residual", type=nonnegative_int,
                   help="the R most recent tokens also held in full precision; default 128 for 4 and 2 bits, 0 for 8")
    p.set_defaults(default_budget=budget)


def policy_option_specs() -> dict:
    """`{dest: (Option, {method: default})}` of every registered method (`kvjax.policies.options.all_options`)."""
    from kvjax.policies.options import all_options

    return all_options()


def add_option(g, dest: str, spec, defaults: dict) -> None:
    """One method option as a flag: its help with each method's default, its parser, choices or constant."""
    from kvjax.policies.options import NO_CONST

    by_value: dict[str, list[str]] = {}
    for name, value in defaults.items():
        by_value.setdefault(repr(value) if isinstance(value, str) else str(value), []).append(name)
    shown = [v for v in by_value if v != "None"] if spec.const is NO_CONST else []  # a switch has no default to say
    if len(shown) == 1 and len(by_value) == 1:
        said = f"; default {shown[0]}"
    elif shown:
        said = "; default " + "; ".join(f"{v} ({', '.join(by_value[v])})" for v in shown)
    else:
        said = ""
    kw = dict(dest=dest, help=spec.help + said)
    if spec.const is not NO_CONST:
        kw |= dict(action="store_const", const=spec.const)
    else:
        kw |= dict(type=spec.type) if spec.type is not None else {}
        kw |= dict(choices=list(spec.choices)) if spec.choices else {}
    g.add_argument(spec.flag, **kw)


def _own_methods_on_parse(p: argparse.ArgumentParser, g) -> None:
    """Before `p` parses, the methods of a user's own classes named in `--policy` / `--compare` (`module:Class`) are
    registered and their fields' options added as flags."""
    parse = p.parse_known_args

    def parse_known_args(args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        names = [v for i, a in enumerate(argv) for v in
                 (argv[i + 1].split(",") if a in ("--policy", "--compare") and i + 1 < len(argv) else
                  a.split("=", 1)[1].split(",") if a.startswith(("--policy=", "--compare=")) else [])]
        known = {a.dest for a in p._actions}
        for name in (n for n in names if ":" in n):
            from kvjax.policies.registry import method

            m = method(name)  # imported and registered: an error names the class
            for dest, spec in m.options.items():
                if dest not in known:
                    add_option(g, dest, spec, {m.name: m.defaults[dest]})
                    known.add(dest)
        return parse(argv, namespace)

    p.parse_known_args = parse_known_args


def quantizer(args: argparse.Namespace):
    """What --kv-bits / --kv-group / --kv-residual do to each policy of a run: store it quantized
    (`kvjax.policies.Quantized`), or nothing without --kv-bits. Checked once, before any policy is built."""
    bits = getattr(args, "kv_bits", None)
    if bits is None:
        given = [f"{f} {getattr(args, k)}" for f, k in (("--kv-group", "kv_group"), ("--kv-residual", "kv_residual"))
                 if getattr(args, k, None) is not None]
        if given:
            raise InvalidInput(f"{', '.join(given)} without --kv-bits: the cache is not quantized")
        return lambda policy: policy
    if bits == 8 and args.kv_group is not None:
        raise InvalidInput(f"--kv-group {args.kv_group} with --kv-bits 8: int8 has one scale per token (the group "
                           "size is KIVI's, for 4 and 2 bits)")
    group = None if bits == 8 else (args.kv_group if args.kv_group is not None else 32)
    residual = args.kv_residual if args.kv_residual is not None else (0 if bits == 8 else 128)
    return lambda policy: Quantized(policy, bits=bits, group=group, residual=residual)


def _budget(args: argparse.Namespace, names: list[str]) -> int | None:
    """--budget as given, or the command's default; an error when it cannot apply, so a budget the
    policies ignore never looks like it was used."""
    budgeted = [n for n in names if n not in NO_BUDGET]
    if args.budget is not None:
        if not budgeted:
            raise InvalidInput(f"--budget {args.budget} does not apply to --policy {','.join(names)}: "
                               + "; ".join(NO_BUDGET_WHY.get(n, f"{n} is sized by its own options") for n in names))
        if args.ratio is not None:
            raise InvalidInput(f"--budget {args.budget} and --ratio {args.ratio} both size the cache: give one")
        return args.budget
    return args.default_budget  # with --ratio, the scored policies use the ratio instead


# Why a policy takes no --budget (said in the error, with what sizes it instead).
NO_BUDGET_WHY = {
    "full": "full keeps every token",
    "kvzip": "kvzip evicts --ratio of all layers' slots together",
    "kvzip-plus": "kvzip-plus evicts --ratio of all layers' slots together",
    "kvgrad": "kvgrad evicts --ratio of all layers' slots together",
    "razor": "razor sizes its local heads with --compression and --buffer, or --ratio",
    "razor-table1": "razor-table1's local heads keep the recent --buffer tokens",
    "duo": "duo's streaming heads keep --sinks + --recent tokens and its other heads everything",
    "duo-kvpress": "duo-kvpress's streaming heads keep the prompt's --sinks + --recent tokens and its other heads "
                   "everything",
    "kvzap": "kvzap evicts the pairs its surrogate scores below --threshold",
    "gate": "gate keeps what the trained gates keep (--bucket rounds it)",
}


def policy_from_args(args: argparse.Namespace, num_layers: int | None = None, model_dir=None) -> Policy:
    """The policy named by --policy, with the options given on the command line.

    An option the policy does not take is an error (e.g. --anchor-slots with --policy streaming).
    `num_layers` is passed to the policies that need the model's depth (PyramidKV); RazorAttention
    without --heads reads `model_dir/heads.json` (`shipped_heads`).
    """
    return policies_from_args(args, [args.policy], num_layers, model_dir=model_dir)[0]


def shipped_heads(args: argparse.Namespace, names: list[str], model_dir) -> None:
    """RazorAttention without --heads takes `model_dir/heads.json` when the model ships one (kvjax-small
    does), in every suite alike; its description names the head table, so the records say which heads
    were used. Only when razor is asked for: --heads is an error for the other policies."""
    if any(n.startswith("razor") for n in names) and getattr(args, "heads", None) is None and model_dir is not None:
        shipped = Path(model_dir) / "heads.json"
        if shipped.is_file():
            args.heads = str(shipped)


def add_compare_args(p: argparse.ArgumentParser, default: str, budget: int = 128) -> None:
    """--policy / --budget / every policy option, plus --compare p1,p2 (`default` when neither is given)."""
    p.add_argument("--compare", help=f"comma-separated policies, one table (default without --policy: {default})")
    add_policy_args(p, default=None, budget=budget)
    p.set_defaults(compare_default=default)


def chosen_policies(p: argparse.ArgumentParser, args: argparse.Namespace, num_layers: int, model_dir=None
                    ) -> tuple[list[str], list[Policy]]:
    """(labels, policies) of --compare, --policy or the default list; a name given twice is labelled name#i.

    RazorAttention without --heads reads `model_dir/heads.json` (`shipped_heads`)."""
    if args.compare and args.policy:
        p.error("give --policy or --compare, not both")
    names = (args.compare or args.policy or args.compare_default).split(",")
    return driver.labels(names), policies_from_args(args, names, num_layers=num_layers, model_dir=model_dir)


def suite_model(args: argparse.Namespace, *, check=None, **load):
    """The model of a suite's command line: --model (the default model without it) loaded with `load` and
    --allow-nonfinite, `check(lm)` run (a suite's own checks of its options against the model, reported before
    the gates'), with --gate-params attached."""
    lm = driver.load_model(args.model, allow_nonfinite=args.allow_nonfinite, **load)
    if check is not None:
        check(lm)
    attach_gate_params(args, lm)
    return lm


def compared(p: argparse.ArgumentParser | None, args: argparse.Namespace, num_layers: int, model_dir=None, *,
             by_room: bool = False):
    """`{label: policy}` of --compare / --policy (`chosen_policies`), or with --ratios each policy at each ratio
    (`policies_at_ratios`); `by_room`: a function of a cell's prompt room giving them (MAT's default beta a
    quarter of that ratio's share of the room)."""
    if not getattr(args, "ratios", None):
        return dict(zip(*chosen_policies(p, args, num_layers, model_dir=model_dir)))
    if args.compare and args.policy:
        p.error("give --policy or --compare, not both")
    names = (args.compare or args.policy or args.compare_default).split(",")
    at = lambda room=None: dict(policies_at_ratios(args, names, num_layers, args.ratios, room=room,  # noqa: E731
                                                   model_dir=model_dir))
    return at if by_room else at()


def policies_from_args(args: argparse.Namespace, names: list[str], num_layers: int | None = None,
                       model_dir=None) -> list[Policy]:
    """One policy per name (`--compare p1,p2`), each given the command-line options it takes.

    An option that none of them takes is an error, as a typo must not be silently ignored; so is a
    --budget that none of them takes, or one given with --ratio. A value a policy refuses is
    reported with its command-line flag."""
    shipped_heads(args, names, model_dir)
    driver.check_names(names)
    budget = _budget(args, names)
    options = given_options(args)
    per_policy = refuse_unused(args, names, options)
    check_modes(args, names, options)
    quantize = quantizer(args)
    out, wrapped = [], False
    for n, kw in zip(names, per_policy):
        where = f"--policy {n}"
        try:
            policy = driver.build_policy(n, budget, kw, num_layers=num_layers, model_dir=model_dir,
                                         chat=getattr(args, "replay_chat", False))
            if getattr(args, "recompress_every", None) and isinstance(policy, Decoding):
                raise InvalidInput(f"--recompress-every {args.recompress_every}: it compresses while decoding on its "
                                   "own schedule (--decode-slots)")
            if getattr(args, "recompress_every", None) and isinstance(policy, ScoredPolicy):
                policy = recompress(policy, args.recompress_every)
                wrapped = True
            if getattr(args, "kv_bits", None) is not None:
                where += f" with --kv-bits {args.kv_bits}"  # a refusal of the quantized cache names its flag
            out.append(quantize(policy))
        except InvalidInput as err:
            # The policy names its parameters (budget=8); on the command line they are flags (--budget 8).
            raise InvalidInput(f"{where}: {_as_flags(str(err), n)}") from None
    if getattr(args, "recompress_every", None) and not wrapped:
        raise InvalidInput(f"--recompress-every {args.recompress_every}: no policy of {','.join(names)} compresses a "
                           "prompt by scores (snapkv, pyramidkv, slimkv, tova, knorm, h2o-prefill)")
    return out


def given_options(args: argparse.Namespace) -> dict:
    """The policy options given on the command line (those of a user's own method too)."""
    dests = set(POLICY_OPTIONS) | {d for n in _names_of(args) if ":" in n for d in REGISTRY[n].options}
    return {k: getattr(args, k) for k in sorted(dests) if getattr(args, k, None) is not None}


def _names_of(args: argparse.Namespace) -> list[str]:
    return [n for v in (getattr(args, "compare", None), getattr(args, "policy", None)) if v for n in v.split(",")]


def refuse_unused(args: argparse.Namespace, names: list[str], options: dict) -> list[dict]:
    """Each policy's share of `options` (`driver.policy_options`); an option none of them takes is an error
    naming its flag, as a typo must not be silently ignored."""
    per_policy, unused = driver.policy_options(names, options)
    if unused:
        raise InvalidInput(f"{', '.join(flag_given(args, k) for k in sorted(unused))}: no policy of "
                           f"{','.join(names)} takes it")
    return per_policy


# Options that say how every policy of a run reads the prompt or positions its keys: in a comparison they
# apply to each policy named, so one that cannot take them is refused rather than run another way.
MODE_OPTIONS = ("prefill_mode", "chunk", "positions")


def check_modes(args: argparse.Namespace, names: list[str], options) -> None:
    for k in MODE_OPTIONS:
        if k not in options:
            continue
        missing = [n for n in names if k not in REGISTRY[n].parameters]
        if missing:
            raise InvalidInput(f"{flag_given(args, k)} {getattr(args, k)} applies to every policy compared, and "
                               f"{', '.join(missing)} cannot take it; leave {', '.join(missing)} out of this run")


def policies_at_ratios(args: argparse.Namespace, names: list[str], num_layers: int, ratios, room: int | None = None,
                       model_dir=None) -> list[tuple[str, Policy]]:
    """(label, policy) for `--ratios`: each policy with a ratio mode at each ratio, labelled `name@r`, and a
    policy sized by its own options (full, gate) once. Each takes the command line's options it has.

    MAT's beta is a token count, not a share: `--anchor-slots`, or, given `room` (the prompt length all rows
    share, as in a RULER cell), a quarter of that ratio's budget, MAT's default."""
    shipped_heads(args, names, model_dir)
    check_modes(args, names, given_options(args))
    out = []
    for n in names:
        params = REGISTRY[n].parameters
        own = argparse.Namespace(**vars(args))
        for k in POLICY_OPTIONS:  # each policy takes its own options (that none takes is checked below)
            if k not in params:
                setattr(own, k, None)
        if "ratio" not in params:
            out.append((n, policies_from_args(own, [n], num_layers, model_dir=model_dir)[0]))
            continue
        for r in ratios:
            own.ratio, own.budget = r, None
            if "anchor_slots" in params and args.anchor_slots is None and room is not None:
                own.anchor_slots = max(1, math.floor((1 - r) * room) // 4)
            out.append((f"{n}@{r:g}", policies_from_args(own, [n], num_layers, model_dir=model_dir)[0]))
    refuse_unused(args, names, {k: v for k, v in given_options(args).items() if k != "ratio"})
    return out


def parse_ratios(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--ratios a,b`: parsed in place into a tuple of fractions removed; it sizes every policy itself."""
    if not args.ratios:
        return
    try:
        args.ratios = tuple(fraction_removed(r) for r in args.ratios.split(",") if r.strip())
    except argparse.ArgumentTypeError as err:
        p.error(f"argument --ratios: {err}")
    if not args.ratios:
        p.error("argument --ratios: no ratio given")
    if args.budget is not None or args.ratio is not None:
        p.error("--ratios sets each policy's size: leave out --budget and --ratio")


def _as_flags(message: str, name: str | None = None) -> str:
    """A policy's parameters in `message` as the command line's flags (`every=` is --recompress-every, or
    --decode-slots for a method that compresses while decoding on its own schedule, R-KV and TriAttention)."""
    own = name is not None and "decode_slots" in REGISTRY[name].options
    every = "decode_slots" if own else "recompress_every"
    return driver.as_flags(message, {*POLICY_OPTIONS, "budget", "recompress_every"}, {"every": every})


def attach_gate_params(args: argparse.Namespace, lm) -> None:
    """Loads --gate-params into the model `lm` (a `LoadedModel`, whose identity records them);
    --policy gate without them is an error."""
    if getattr(args, "gate_params", None):
        driver.attach_gates(lm, args.gate_params)
    elif getattr(args, "policy", None) == "gate" or "gate" in (getattr(args, "compare", None) or "").split(","):
        raise InvalidInput("--policy gate needs --gate-params DIR (from python -m kvjax.experiments.train_gate)")



# ---- training text (offline) ----


def read_text(files: list[str] | None) -> str:
    """The text of `files` (--data / --text), or the offline default text; a missing, binary or non-UTF-8
    file is one error naming it."""
    if not files:
        return default_text()
    parts = []
    for f in files:
        try:
            parts.append(Path(f).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise MissingFile(f"{f} does not exist") from None
        except IsADirectoryError:
            raise InvalidInput(f"{f} is a directory; pass text files") from None
        except UnicodeDecodeError as err:
            raise InvalidInput(f"{f} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    return "\n\n".join(parts)


def default_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def windows(ids: list[int], seq_len: int, length_flag: str = "--seq-len") -> np.ndarray:
    """`ids` cut into whole `seq_len`-token windows; fewer tokens than one window is an error naming the command's
    own length flag (`length_flag`)."""
    n = len(ids) // seq_len
    if n == 0:
        raise InvalidInput(f"the data has {len(ids)} tokens, fewer than one {length_flag} {seq_len} window")
    return np.asarray(ids[: n * seq_len], np.int32).reshape(n, seq_len)


# ---- training and evaluation text, disjoint by construction ----

# Given --data files, the last fifth of their text is evaluation's. A share of the text, not a count of
# windows: training and evaluation commands take different --seq-len and window counts, and a cut in
# windows moves with them (issue 65: train_gate held out its last 16 windows, eval_gate scored the last
# 32, so 16 scored windows had been trained on).
HELD_OUT_SHARE = 0.2
REPEATED_LINE = 20  # the shortest held-out line training skips where it repeats it (`split_text`)
# Joins a training run's identity: a run begun under the old rule (all of the text) is not resumed on another
SPLIT_RULE = ("default text: kvjax.experiments.corpus's train / heldout topics; --data: the last 20 % held out; "
              "training skips held-out lines of 20+ characters")


def split_text(files: list[str] | None) -> tuple[str, str]:
    """(training text, held-out text) of `files` (--data), or of the offline default. Training commands read
    only the first and evaluation commands only the second, so no choice of windows, lengths or counts makes
    them share a character. The default text splits as every offline suite does (`kvjax.experiments.corpus`: one
    topic in ten held out by a hash of its name), so the held-out reference text that zero-shot and
    LongBench passages are built from is never trained on either; given files, the last `HELD_OUT_SHARE`
    of their text (from a line's start) is held out. A line the held-out text also has is not trained on."""
    if not files:
        from kvjax.experiments import corpus

        train, held = ("\n\n".join(t for _, t in corpus.doc_documents(split)) for split in ("train", "heldout"))
    else:
        text = read_text(files)
        cut = int(len(text) * (1 - HELD_OUT_SHARE))
        cut = text.rfind("\n", 0, cut) + 1 or cut  # a line's start, where there is one
        train, held = text[:cut], text[cut:]
    # A text can say the same thing twice: pydoc's "attribute-access" and "context-managers" topics are
    # sections of "specialnames", word for word, and "try" repeats paragraphs of "exceptions". Training skips
    # every line the held-out text has, of at least `REPEATED_LINE` characters (short ones, "", "else:", are
    # common to any two texts and say nothing).
    seen = {line.strip() for line in held.splitlines() if len(line.strip()) >= REPEATED_LINE}
    return "\n".join(line for line in train.split("\n") if line.strip() not in seen), held


def trained_on_scored_text(identity: dict, data: list[str] | None, held_out_only: bool = True) -> str | None:
    """Why gates trained with `identity` (their training/train_identity.json) have read text that an evaluation
    scores, or None. The evaluation reads `data` (text files; None: the default text's held-out part), only its
    held-out part (`held_out_only`, as `kvjax.experiments.eval_gate`) or all of it (a suite's --text or --data).
    Under the split, a held-out part is never trained on; so the cases that overlap are gates trained before
    the split (they read all of their text) on the text scored, the two commands given different --data that
    share a file (each splits its own concatenation), and a suite reading the whole of a training file."""
    from kvjax.experiments.records import content_fingerprint

    trained = identity.get("--data content") or None  # None: the default text
    scored = [content_fingerprint(f) for f in data] if data else None
    if trained != scored and not set(trained or ()) & set(scored or ()):
        return None  # another text altogether: nothing scored was trained on
    if identity.get("held-out text") != SPLIT_RULE:
        return "the gates were trained on all of that text (before training and evaluation text were split)"
    if scored is not None and not held_out_only:
        return "the gates were trained on the first four fifths of it, and this reads all of it"
    if trained != scored:
        return (f"the gates were trained with --data {' '.join(identity.get('--data') or [])}, which shares a file "
                "with it but splits differently")
    return None


def refuse_trained_text(gate_params: str | None, data: list[str] | None, data_flag: str = "--data",
                        held_out_only: bool = False) -> None:
    """An error naming the options where the gates in `gate_params` were trained on text that an evaluation of
    `data` (`data_flag`; None: the default held-out text) scores (`trained_on_scored_text`). Gates saved by the
    API carry no record of their training (no training/train_identity.json): nothing to check."""
    import json

    record = Path(gate_params or "") / "training" / "train_identity.json"
    why = gate_params and record.is_file() and trained_on_scored_text(json.loads(record.read_text()), data,
                                                                      held_out_only)
    if why:
        raise InvalidInput(f"--gate-params {gate_params} with {data_flag} {' '.join(data or ['(default)'])}: {why}; "
                           "evaluate them on other text, or retrain them")


def training_windows(tok, files: list[str] | None, seq_len: int, length_flag: str = "--seq-len") -> np.ndarray:
    """The `seq_len`-token windows a training command reads: the training part of `split_text` only."""
    return windows(tok(split_text(files)[0], add_special_tokens=False)["input_ids"], seq_len, length_flag)


def held_out_windows(tok, files: list[str] | None, seq_len: int, n: int, count_flag: str = "--windows",
                     length_flag: str = "--seq-len") -> np.ndarray:
    """The first `n` `seq_len`-token windows of the held-out part of `split_text`: what an evaluation scores.
    Asking for more than it holds is an error naming the command's options (`count_flag`, `length_flag`): more
    would be trained-on text."""
    ids = tok(split_text(files)[1], add_special_tokens=False)["input_ids"]
    have = len(ids) // seq_len
    if have < n:
        fix = f"ask for at most {have}" if have else f"pass a shorter {length_flag}"
        raise InvalidInput(f"{count_flag} {n} with {length_flag} {seq_len}: the held-out part of "
                           f"{'--data' if files else 'the default text'} ({len(ids)} tokens) has {have} windows of "
                           f"{seq_len} tokens, and training reads the rest; {fix}")
    return windows(ids, seq_len, length_flag)[:n]
