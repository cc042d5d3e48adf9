"""Generation: a jitted prefill and a decode loop in one `lax.while_loop`.

The compiled functions are written with `kvjax.engine.compiled`, pure in `(graphdef, state)`. Prompts are left padded to
a bucket length (positions -1 on padding): every prompt length in a bucket
reuses one compilation of prefill and one of the decode loop. The cache is
donated to the decode loop, so the loop updates it in place.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from kvjax import drive, engine, sharding
from kvjax.after_prompt import PromptPass
from kvjax import cache as kvcache
from kvjax.cache import Cache
from kvjax.cache import tree_nbytes as kvcache_bytes
from kvjax.engine import MIN_BUCKET, bucket_length, compiled
from kvjax.errors import InvalidInput, NonFiniteError, PromptTooLong
from kvjax.model import CachedLM
from kvjax.policies.base import Policy
from kvjax.policies.plan import Plan



@dataclasses.dataclass(frozen=True)
class Sampling:
    """Greedy when `temperature == 0`, else temperature + nucleus (top-p) sampling."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        # NaN fails every comparison, so test for what is valid rather than for what is not.
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidInput(f"temperature={self.temperature} must be a finite number >= 0")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidInput(f"top_p={self.top_p} must be in (0, 1]")


def tempered(logits: Float[Array, "b V"], temperature: float) -> Float[Array, "b V"]:
    """`logits / temperature` shifted by each row's maximum (which sampling ignores), so it never overflows: every
    entry is in [-inf, 0] and the maximum is 0, for any finite temperature > 0. `logits / 1e-38` is inf in float32
    (and `inf - inf` NaN), where the limit is greedy: a tiny temperature here leaves the row's maximum at 0 and the
    rest at -inf (or hugely negative), so sampling is the argmax, ties shared."""
    x = logits.astype(jnp.float32)
    gap = x - jnp.max(x, axis=-1, keepdims=True)  # <= 0, exactly 0 at the maximum
    # a temperature flushed to 0 in float32 would make 0 / 0 at the maximum: its scaled gap is 0 whatever T is
    return jnp.where(gap == 0, 0.0, gap / jnp.float32(temperature))


def sample(logits: Float[Array, "b V"], key: PRNGKeyArray, sampling: Sampling) -> Int[Array, "b"]:
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = tempered(logits, sampling.temperature)
    if sampling.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the top token always survives).
        drop_sorted = (jnp.cumsum(probs, axis=-1) - probs) >= sampling.top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def truncate_middle(ids: Sequence[int], max_len: int) -> list[int]:
    """LongBench's middle truncation: keep the first and last `max_len // 2` tokens."""
    ids = list(ids)
    if len(ids) <= max_len:
        return ids
    half = max_len // 2
    return ids[:half] + ids[len(ids) - (max_len - half) :]


def pad_left(prompts: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """tokens `[b, length]` left padded with `pad_id`, positions `[b, length]` (-1 on padding)."""
    b = len(prompts)
    tokens = np.full((b, length), pad_id, np.int32)
    positions = np.full((b, length), -1, np.int32)
    for i, p in enumerate(prompts):
        n = len(p)
        tokens[i, length - n :] = p
        positions[i, length - n :] = np.arange(n)
    return tokens, positions


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    step: Int[Array, ""]  # index of the next token to write into `tokens`
    tokens: Int[Array, "b n"]
    pos: Int[Array, "b"]  # position of tokens[:, step - 1], the token decoded next
    done: Array  # [b] bool: EOS emitted
    nonfinite: Int[Array, "b"]  # index of the first token whose logits were not finite, -1 if none
    key: PRNGKeyArray
    cache: Cache


def _all_finite(logits: Float[Array, "b V"]) -> Array:
    return jnp.all(jnp.isfinite(logits), axis=-1)


@compiled(static=("plan", "sampling"))
def prefill_fn(model, tokens, positions, key, *, plan, sampling):
    """The prompt under a sized plan (`kvjax.drive.plan(model, policy, max_len, t)`, the compiled key, not `max_len`),
    and the first token sampled from its last logits."""
    logits, cache = drive.prompt(model, tokens, positions, plan)
    return sample(logits, key, sampling), _all_finite(logits), cache


@compiled(static=("plans", "sampling"))
def prefill_many_fn(model, tokens, positions, key, *, plans, sampling):
    """One plain prompt pass for several sized plans (`kvjax.drive.shared`): the first token, sampled from the
    logits every plan shares, and each plan's cache."""
    logits, caches = drive.shared(model, tokens, positions, plans)
    return sample(logits, key, sampling), _all_finite(logits), caches


@compiled(static=("hidden", "colsum", "sampling"))
def capture_fn(model, tokens, positions, key, *, hidden, colsum, sampling):
    """The plain prompt pass, each layer's attention inputs kept (`kvjax.drive.capture`): the first token, as
    `prefill_many_fn`'s, and what `recache_fn` caches each group of plans from."""
    logits, captured = drive.capture(model, tokens, positions, hidden, colsum)
    return sample(logits, key, sampling), _all_finite(logits), captured


@compiled(static=("plans",))
def recache_fn(model, tokens, positions, captured, *, plans):
    """Each sized plan's cache of the prompt `capture_fn` read (`kvjax.drive.recache`)."""
    return drive.recache(model, tokens, positions, captured, plans)


@functools.partial(jax.jit, static_argnames=("sampling",))
def first_token(logits, key, *, sampling):
    """The first generated token from the prompt's last logits, and whether they were finite."""
    return sample(logits, key, sampling), _all_finite(logits)


@compiled(static=("plan", "sampling"), donate=("cache",))
def question_fn(model, cache, tokens, positions, key, *, plan, sampling):
    """A question extends the compressed context's cache as decoding would, token by token (`kvjax.drive.follow`: in
    one forward where the plan's decoding only appends), so the context was compressed without it; returns the first
    generated token, as prefill does."""
    logits, cache = drive.follow(model, tokens, positions, cache, plan)
    return sample(logits, key, sampling), _all_finite(logits), cache


# The decode loops' progress reporters, by call: `generate(progress=...)` registers its callback under a fresh id
# for the length of its loop and passes the id as an array, so the loop compiled with `progress=True` is shared by
# every call and concurrent generations never report to each other's callbacks.
_reporters: dict[int, object] = {}
_next_reporter = iter(range(1, 2**31 - 1))


def _tick(reporter, step) -> None:
    report = _reporters.get(int(reporter))
    if report is not None:
        report(int(step))


@compiled(static=("plan", "sampling", "buffer", "progress"), donate=("cache",))
def decode_fn(model, cache, first, first_finite, pos, key, eos, max_new, pad_id, reporter, *, plan, sampling, buffer,
              progress=False):
    """The decode loop under the sized plan the cache was made for. `eos` (ids, padded with -1), `max_new`, `pad_id`
    and `reporter` (the id of the progress callback) are arrays, so new values never recompile; `buffer` (static) is
    the token buffer, `max_new` rounded up to a bucket."""
    b = first.shape[0]

    def cond(s: DecodeState):
        return (s.step < max_new) & ~jnp.all(s.done)

    def body(s: DecodeState) -> DecodeState:
        last = s.tokens[:, s.step - 1]
        logits, c = drive.decode(model, last, s.pos, s.cache, plan)
        key, sub = jax.random.split(s.key)
        tok = jnp.where(s.done, pad_id, sample(logits, sub, sampling))
        bad = ~s.done & ~_all_finite(logits) & (s.nonfinite < 0)
        if progress:
            jax.debug.callback(_tick, reporter, s.step)
        return DecodeState(
            step=s.step + 1,
            tokens=s.tokens.at[:, s.step].set(tok),
            pos=s.pos + 1,
            done=s.done | jnp.isin(tok, eos),
            nonfinite=jnp.where(bad, s.step, s.nonfinite),
            key=key,
            cache=c,
        )

    init = DecodeState(
        step=jnp.int32(1),
        tokens=jnp.full((b, buffer), pad_id, jnp.int32).at[:, 0].set(first),
        pos=pos,
        done=jnp.isin(first, eos),
        nonfinite=jnp.where(first_finite, -1, 0).astype(jnp.int32),
        key=key,
        cache=cache,
    )
    out = jax.lax.while_loop(cond, body, init)
    return out.tokens, out.step, out.nonfinite, out.cache



def eos_array(eos: Sequence[int]) -> np.ndarray:
    """EOS ids as an int32 array padded with -1 (never a token) to a power of two >= 4, so one or two
    stop ids (LongBench's extra newline) share a compilation."""
    n = max(4, 1 << max(0, math.ceil(math.log2(max(len(eos), 1)))))
    out = np.full((n,), -1, np.int32)
    out[: len(eos)] = eos
    return out


def check_finite_steps(nonfinite: np.ndarray, what: str = "logits", step_name: str = "generated token") -> None:
    """Raises `NonFiniteError` naming the first row (and its step) whose `what` were not finite;
    `nonfinite[b]` holds each row's first bad step, -1 for a clean row."""
    rows = np.flatnonzero(np.asarray(nonfinite) >= 0)
    if rows.size:
        r = int(rows[0])
        raise NonFiniteError(
            f"non-finite {what} (NaN or inf) at {step_name} {int(nonfinite[r])} of row {r}"
            + (f" ({rows.size} rows affected)" if rows.size > 1 else "")
            + "; the model's numbers are broken (weights, dtype overflow): nothing was scored or returned"
        )


@dataclasses.dataclass
class Generation:
    """What `generate` returns: the new tokens per row, how many each row made, the final cache, and the
    prefill / decode timings (compilation excluded from the decode rate)."""

    tokens: np.ndarray  # [b, max_new_tokens], pad after EOS
    lengths: np.ndarray  # [b] tokens generated per row, EOS included
    # the final cache (inspect with kvjax.cache.kept_positions); None: generate_many(keep_caches=False)
    cache: Cache | None
    prompt_bucket: int
    room: int  # cache slots reserved after the prompt bucket: the question bucket + the token buffer
    prefill_s: float
    decode_s: float
    decode_steps: int  # loop iterations run (tokens after the first)
    # [b] KV bytes the compressed prompt's cache holds (`kvjax.cache.held_bytes`: its slots holding a token, measured
    # once the prompt is compressed, before the question and the new tokens), and the full cache's for the same
    # prompt tokens (`kvjax.cache.full_bytes`)
    held_bytes: np.ndarray | None = None
    full_bytes: np.ndarray | None = None

    @property
    def held_fraction(self) -> np.ndarray | None:
        """`[b]` held_bytes / full_bytes: the share of the full cache's KV bytes the policy really holds."""
        return None if self.held_bytes is None else self.held_bytes / np.maximum(self.full_bytes, 1)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.tokens.shape[0] * self.decode_steps / max(self.decode_s, 1e-9)

    def sequences(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]


def token_ids(ids, vocab_size: int, what: str = "prompt") -> list[int]:
    """`ids` (a sequence or 1-D array of token ids) as a list of ints, or an `InvalidInput` naming the
    problem: a float, a string or a bool is refused rather than coerced with `int()`, and an id outside
    `[0, vocab_size)` rather than read from the end of the embedding (-3 is not vocab - 3)."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise InvalidInput(f"{what}: expected a sequence of token ids, got an array of shape {arr.shape}")
    flagged = not isinstance(ids, np.ndarray) and any(isinstance(x, (bool, np.bool_)) for x in ids)
    if arr.size and (flagged or arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
        bad = next((x for x in (ids.tolist() if isinstance(ids, np.ndarray) else ids)
                    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer))), arr.flat[0])
        raise InvalidInput(f"{what}: token ids must be integers, got {type(bad).__name__} {bad!r}")
    out = arr.astype(np.int64)
    wrong = out[(out < 0) | (out >= vocab_size)]
    if wrong.size:
        raise InvalidInput(f"{what}: token id {int(wrong[0])} is outside the vocabulary [0, {vocab_size})")
    return out.tolist()


def prompt_rows(prompts, vocab_size: int, what: str = "prompts") -> list[list[int]]:
    """A batch of prompts as lists of ids: a list of sequences, or a 2-D array (one prompt per row)."""
    if hasattr(prompts, "ndim") and hasattr(prompts, "shape"):
        if prompts.ndim != 2:
            raise InvalidInput(f"{what}: an array of prompts must be 2-D (one prompt per row); got shape "
                               f"{tuple(prompts.shape)} (a single prompt: [ids])")
        prompts = list(np.asarray(prompts))
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise InvalidInput(f"{what}: expected a list of token-id sequences, got {type(prompts).__name__}")
    if prompts and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in prompts):
        raise InvalidInput(f"{what}: got one sequence of ids; pass a list of prompts, e.g. [ids]")
    return [token_ids(p, vocab_size, f"{what}[{i}]") for i, p in enumerate(prompts)]


def check_policy(policy) -> None:
    if not isinstance(policy, Policy):
        hint = f"; kvjax.policies.make_policy({policy!r}, budget) builds one by name" if isinstance(policy, str) else ""
        raise InvalidInput(f"policy: expected a kvjax Policy object (e.g. StreamingLLM(budget=256)), got "
                           f"{type(policy).__name__} {policy!r}{hint}")


def check_positions(plan: Plan, cfg, length: int, what: str) -> None:
    """A `length`-token text read at absolute positions must fit the model's window: past it, positions the
    model never saw would be scored silently (`generate` refuses them too)."""
    if plan.absolute and length > cfg.max_position_embeddings:
        raise InvalidInput(f"{what} of {length} tokens would be read at absolute positions up to {length - 1}, past "
                           f"the model's max_position_embeddings={cfg.max_position_embeddings}: shorten it, or use "
                           "positions='rolling' (StreamingLLM's protocol: keys rotated by their rank in the cache)")


INT32_MAX = int(np.iinfo(np.int32).max)  # positions, lengths and the token buffer are int32 on the device


def check_int32(max_new_tokens: int, max_len: int) -> None:
    """Refuses `max_new_tokens` whose cache of `max_len` positions (the prompt's and the new tokens' buckets) would
    pass int32's largest: positions, lengths and the token buffer are int32 on the device."""
    if max_len > INT32_MAX:
        raise InvalidInput(f"max_new_tokens={max_new_tokens}: the prompt and the new tokens, rounded up to their "
                           f"buckets, span {max_len} positions, past int32's largest ({INT32_MAX}); generate fewer "
                           "tokens")


def memory_bytes(mesh=None) -> int | None:
    """The memory a generation may fill: its devices' (`bytes_limit`, GPU and TPU; the devices of `mesh` when the
    model is sharded), else the host's physical memory (a CPU backend); None where neither is known."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
    if all(limits):
        return int(sum(limits))
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(model: CachedLM, plans: Sequence[Plan], batch: int, max_len: int, buffer: int, mesh=None) -> None:
    """Refuses, before anything is allocated, a generation whose caches (their shapes, from `jax.eval_shape`) and
    token buffer hold more bytes than the memory it runs in (`memory_bytes`): asked for 10**11 new tokens, a full
    cache and the buffer would otherwise be allocated until the process dies."""
    have = memory_bytes(mesh)
    if have is None:
        return
    caches = sum(kvcache_bytes(jax.eval_shape(lambda p=p: drive.empty_cache(model, p, batch))) for p in plans)
    need = caches + 2 * batch * buffer * 4  # the tokens and their positions, int32
    if need > have:
        raise InvalidInput(f"{len(plans)} cache(s) of {max_len} slots for {batch} row(s) and a {buffer}-token buffer "
                           f"need {need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB this runs in; generate "
                           "fewer tokens (max_new_tokens), fewer rows, or use a policy with a budget")


def position_limit(plan: Plan, cfg, max_new_tokens: int) -> int | None:
    """The longest prompt a policy (its `plan` on a model of `cfg`, `kvjax.drive.plan(model, policy)`) can read and
    then generate `max_new_tokens`, or None when there is no limit.

    Absolute positions grow through generation. Rolling ones stay below the cache size: with a
    prompt read token by token or in chunks, no position ever passes it (StreamingLLM's setting);
    a whole prompt attended at once is attended at its true positions."""
    if plan.absolute:
        return cfg.max_position_embeddings - max_new_tokens
    return None if plan.policy.prefill_mode in ("stream", "chunked") else cfg.max_position_embeddings


def generate(
    model: CachedLM,
    prompts: Sequence[Sequence[int]],
    policy: Policy,
    *,
    max_new_tokens: int = 64,
    sampling: Sampling = Sampling(),
    key: PRNGKeyArray | None = None,
    eos_ids: Sequence[int] | None = None,
    pad_id: int | None = None,
    truncate: bool = False,
    min_bucket: int = MIN_BUCKET,
    progress=None,
    questions: Sequence[Sequence[int]] | None = None,
) -> Generation:
    """Generates up to `max_new_tokens` per prompt (a batch of token-id lists) under `policy`.

    With `questions` (one per prompt), the question-agnostic protocol (kvpress's default): each
    prompt is a context compressed alone, then its question extends the compressed cache token by
    token through the policy's decode rule (a policy that compresses only at prefill, e.g. SnapKV,
    appends it whole, read in one forward as kvpress reads it; one that evicts while decoding, e.g.
    StreamingLLM, applies its rule, token by token: `kvjax.drive.follow`), then generation follows.
    Without them (question-aware), prompt and question are one prompt. One prompt with several
    questions is compressed once: each question (a row of the result) extends its own copy of that
    one compressed cache.

    With `truncate=True`, prompts too long for the model are middle-truncated (LongBench's rule;
    with questions, the contexts are); otherwise they are an error. Non-finite logits raise
    `NonFiniteError` naming the row and the generated token. `progress(step)`, if given, is called
    from the decode loop after each generated token (a separate compilation of the loop).

    Compiles (docs/getting-started.md): the prompt pass once per policy, prompt bucket (the longest prompt rounded up
    to a power of two, at least `min_bucket`), batch and room after the prompt (the questions' bucket plus the new
    tokens' buffer, `max_new_tokens` rounded up the same way); the decode loop once per policy, bucket, batch, buffer
    and `sampling`. A policy whose slot counts do not grow with the room (StreamingLLM's ring) compiles its prompt
    pass once for every buffer. The exact `max_new_tokens`, EOS ids and pad id are arrays: they compile nothing.
    """
    return generate_many(model, prompts, [policy], max_new_tokens=max_new_tokens, sampling=sampling, key=key,
                         eos_ids=eos_ids, pad_id=pad_id, truncate=truncate, min_bucket=min_bucket, progress=progress,
                         questions=questions)[0]


# The most plans one program caches a prompt for (a shared pass, or a recache of a captured one). Each plan keeps its
# own caches live through every layer, so a program's memory grows with its plans (all 22 compressors of the report's
# RULER section in one unrolled pass compiled for 3 min 49 s and held 13.5 GB on SmolLM2 at 4K), while its time
# barely does: on SmolLM2, 5 rows of 4096 tokens, a pass of 8 plans ran 1.03x as long as a pass of 4 and held 1.5 GB
# more at its peak (`benchmarks/results/compile_cpu_smollm2_shared-pass-batch5.md`). `shared_groups` splits the
# plans into as few groups as this allows, of nearly equal size, so the largest is as small as that number permits;
# with more than one group the model still runs once (`capture_fn`, then `recache_fn` per group).
SHARED_PASS_PLANS = 8


def shared_groups(shared: Sequence[int], cap: int) -> list[tuple[int, ...]]:
    """`shared` (the indices of the plans that can share a prompt pass, in order) cut into the fewest runs of at most
    `cap`, their sizes differing by at most one: 25 plans at 8 a pass are 7 + 6 + 6 + 6, not 8 + 8 + 8 + 1. No
    groups for fewer than two plans (a lone plan prefills alone)."""
    if len(shared) < 2:
        return []
    n = -(-len(shared) // cap)
    size, extra = divmod(len(shared), n)
    bounds = np.cumsum([0] + [size + (g < extra) for g in range(n)])
    return [tuple(shared[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def generate_many(
    model: CachedLM,
    prompts: Sequence[Sequence[int]],
    policies: Sequence[Policy],
    *,
    max_new_tokens: int = 64,
    sampling: Sampling = Sampling(),
    key: PRNGKeyArray | None = None,
    eos_ids: Sequence[int] | None = None,
    pad_id: int | None = None,
    truncate: bool = False,
    min_bucket: int = MIN_BUCKET,
    progress=None,
    questions: Sequence[Sequence[int]] | None = None,
    keep_caches: bool = True,
    pad_rows: int | None = None,
) -> list[Generation]:
    """`generate` under each of `policies`, one `Generation` per policy, in order: the same result as one call
    per policy, but the policies that attend their prompt as one plain causal pass (whole-prompt prefill, no
    eq. 4 mask, no gates: SnapKV, PyramidKV, SlimKV, TOVA, KNorm, StreamingLLM, H2O, FullCache, ...) share that
    pass, each compressing it under its own rule (`kvjax.drive.shared`). More than `SHARED_PASS_PLANS` such plans
    are cut into groups: the model's pass runs once, keeping each layer's attention inputs (`kvjax.drive.capture`),
    and each group caches the prompt from them (`kvjax.drive.recache`), with the same caches as its own pass. A
    sweep of prompt compressors then pays for one forward instead of one per policy. Prompts are truncated (with
    `truncate`) to the shortest position limit among the policies. `keep_caches=False`: each `Generation.cache` is None, its
    policy's cache freed once it has generated (a suite that reads only the tokens holds one policy's cache at a time,
    not every policy's at the end). `pad_rows`: fewer rows than this are run as this many, the last row repeated and
    its copies' outputs dropped, so a suite's last, smaller batch reuses the programs compiled for its full ones
    (rows are independent: the results are those of the rows alone)."""
    cfg = model.cfg
    if not policies:
        raise InvalidInput("policies: give at least one policy")
    for policy in policies:
        check_policy(policy)
    if max_new_tokens < 1:
        raise InvalidInput(f"max_new_tokens={max_new_tokens} must be >= 1")
    prompts = prompt_rows(prompts, cfg.vocab_size)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidInput("every prompt needs at least one token")
    if questions is not None:
        questions = prompt_rows(questions, cfg.vocab_size, "questions")
        if len(questions) != len(prompts) and len(prompts) != 1 or any(len(q) == 0 for q in questions):
            raise InvalidInput(f"questions: one non-empty question per prompt, or several for one prompt; got "
                               f"{len(questions)} for {len(prompts)} prompts")
    if sampling.temperature > 0 and key is None:
        raise InvalidInput(f"sampling at temperature {sampling.temperature} needs a key (key=jax.random.key(seed)): "
                           "without one every call would draw the same sample")
    if pad_id is not None:
        token_ids([pad_id], cfg.vocab_size, "pad_id")
    if eos_ids is not None:  # integers; one outside the vocabulary is never generated, which is harmless
        token_ids(list(eos_ids), np.iinfo(np.int32).max, "eos_ids")
    real = max(len(prompts), len(questions or ()))  # the rows asked for; padding rows are dropped at the end
    if pad_rows is not None:
        if pad_rows < 1:
            raise InvalidInput(f"pad_rows={pad_rows} must be >= 1")
        if questions is not None and len(questions) != len(prompts):
            raise InvalidInput("pad_rows pads prompt rows: give one question per prompt, not several for one prompt")
        extra = max(0, pad_rows - len(prompts))
        prompts = prompts + [prompts[-1]] * extra
        questions = None if questions is None else questions + [questions[-1]] * extra
    asked = questions or [[] for _ in prompts]
    rows = prompts if len(prompts) == len(asked) else prompts * len(asked)  # one prompt, several questions
    longest = max(len(p) + len(q) for p, q in zip(rows, asked))
    # the strictest position limit among the policies (None: rolling positions read in pieces, no limit)
    plans = [drive.plan(model, policy) for policy in policies]  # the one place each policy is planned
    limits = [(position_limit(plan, cfg, max_new_tokens), plan) for plan in plans]
    bounded = [(lim, plan) for lim, plan in limits if lim is not None]
    if bounded:
        limit, plan = min(bounded, key=lambda x: x[0])
        if longest > limit:
            fit = limit - max(map(len, asked))  # truncation cuts contexts, never questions
            if not truncate or fit < 2:
                raise PromptTooLong(longest, max_new_tokens, cfg.max_position_embeddings, absolute=plan.absolute,
                                    truncate=truncate)
            prompts = [truncate_middle(p, fit) for p in prompts]
    longest = max(map(len, prompts))
    eos = tuple(eos_ids if eos_ids is not None else cfg.eos_token_ids)
    pad = pad_id if pad_id is not None else (cfg.pad_token_id if cfg.pad_token_id is not None else 0)
    bucket = bucket_length(longest, min_bucket)
    tokens, positions = pad_left(prompts, bucket, pad)
    key = jax.random.key(0) if key is None else key
    k_prefill, k_decode = jax.random.split(key)
    graphdef, state = engine.split(model)
    mesh = sharding.mesh_of(state)  # parameters placed by kvjax.sharding.shard_model
    tokens, positions = sharding.shard_batch(tokens, mesh), sharding.shard_batch(positions, mesh)

    q_bucket = bucket_length(max(map(len, asked)), min_bucket) if questions is not None else 0
    # Lengths that vary between calls stay out of the compiled shapes: the new tokens get a bucketed
    # buffer (max_new_tokens 16 and 17 share one compilation), EOS ids a padded array.
    buffer = bucket_length(max_new_tokens, min_bucket)
    room = q_bucket + buffer  # cache slots after the context: the question, then the new tokens

    check_int32(max_new_tokens, bucket + room)
    sized = [plan.sized(bucket + room, bucket) for plan in plans]
    check_memory(model, sized, len(rows), bucket + room, buffer, mesh)
    shared = [i for i, plan in enumerate(sized) if plan.plain_prompt_pass] if len(policies) > 1 else []
    groups = shared_groups(shared, SHARED_PASS_PLANS)
    group_of = {i: group for group in groups for i in group}
    # Each group's caches are made when its first policy's turn comes, and dropped as their policies finish: the
    # device holds one group's prompt caches at a time, not every shared policy's at once. One group is one pass
    # (`prefill_many_fn`); several share one pass of the model (`capture_fn`), its attention inputs held until the
    # last group is recached from them (`recache_fn`), instead of one forward per group.
    captured = None
    prefilled: dict[int, tuple] = {}
    out = [None] * len(policies)
    replays: dict = {}  # the hooks' memo (KVzip's replay scores per row, shared by KVzip policies)
    order = sorted(range(len(policies)), key=lambda i: (group_of[i][0] if i in group_of else i, i))
    for i in order:
        policy = policies[i]
        if i in group_of and i not in prefilled:
            group = group_of[i]
            plans = tuple(sized[j] for j in group)
            t0 = time.perf_counter()
            if len(groups) == 1:
                first, first_finite, caches = prefill_many_fn.pure(graphdef, state, tokens, positions, k_prefill,
                                                                   plans=plans, sampling=sampling)
                first.block_until_ready()
                seconds = (time.perf_counter() - t0) / len(group)  # each policy's share of the one pass
            else:
                if captured is None:
                    pass_first, pass_finite, captured = capture_fn.pure(
                        graphdef, state, tokens, positions, k_prefill, sampling=sampling,
                        hidden=any(lp.prefill_stats().hidden for j in shared for lp in sized[j].layers),
                        colsum=any(lp.prefill_stats().colsum for j in shared for lp in sized[j].layers))
                    pass_first.block_until_ready()
                    pass_share = (time.perf_counter() - t0) / len(shared)  # each shared policy's share of the pass
                    t0 = time.perf_counter()
                first, first_finite = pass_first, pass_finite
                caches = recache_fn.pure(graphdef, state, tokens, positions, captured, plans=plans)
                jax.block_until_ready(caches)
                seconds = pass_share + (time.perf_counter() - t0) / len(group)
                if group == groups[-1]:
                    captured = None
            for j, cache in zip(group, caches):
                prefilled[j] = (first, first_finite, cache, seconds)
            del caches
        t0 = time.perf_counter()
        if i in prefilled:
            first, first_finite, cache, shared_s = prefilled.pop(i)
        else:
            shared_s = 0.0
            if policy.prefill_mode == "chunked":
                # One compiled chunk step looped on the host: a prompt of any bucket compiles nothing new, and the
                # device holds the cache and one chunk, never the whole prompt's activations.
                logits, cache, _ = engine.chunks(model, tokens, positions, sized[i])
                first, first_finite = first_token(logits, k_prefill, sampling=sampling)
            else:
                first, first_finite, cache = prefill_fn.pure(graphdef, state, tokens, positions, k_prefill,
                                                             plan=sized[i], sampling=sampling)
        first.block_until_ready()
        out[i] = _continue(model, graphdef, state, mesh, sized[i], cache, first, first_finite, prompts, questions,
                           k_prefill, k_decode, eos, pad, max_new_tokens, sampling, buffer, bucket, room, q_bucket,
                           progress, t0, shared_s, replays)
        if not keep_caches:
            out[i] = dataclasses.replace(out[i], cache=None)
        elif real < len(rows):
            out[i] = dataclasses.replace(out[i], cache=jax.tree.map(lambda x: x[:real], out[i].cache))
        if real < len(rows):
            g = out[i]
            out[i] = dataclasses.replace(g, tokens=g.tokens[:real], lengths=g.lengths[:real],
                                         held_bytes=g.held_bytes[:real], full_bytes=g.full_bytes[:real])
        del cache
    return out


def _continue(model, graphdef, state, mesh, plan, cache, first, first_finite, prompts, questions, k_prefill,
              k_decode, eos, pad, max_new_tokens, sampling, buffer, bucket, room, q_bucket, progress, t0,
              shared_s, replays) -> Generation:
    """After a policy's prompt pass: its questions (agnostic protocol), then the decode loop."""
    # the method's own hook (KVzip replays the context; the Attention-Gate cuts its cache to what it kept)
    plan, cache = plan.policy.after_prompt(PromptPass(model, plan, cache, prompts, bucket + room, bucket, replays))
    ends = np.asarray([len(p) for p in prompts], np.int32)
    held, full = kvcache.held_bytes(cache), kvcache.full_bytes(cache, ends)
    if questions is not None and len(questions) > len(prompts):  # one compression, one copy per question
        cache = jax.tree.map(lambda x: jnp.repeat(x, len(questions), axis=0), cache)
        ends = np.repeat(ends, len(questions))
        held, full = np.repeat(held, len(questions)), np.repeat(full, len(questions))
    if questions is not None:
        # Left padded, so every row's last step is its question's last token; positions continue the context's.
        q_tokens, q_pos = pad_left(questions, q_bucket, pad)
        q_pos = np.where(q_pos >= 0, q_pos + ends[:, None], -1).astype(np.int32)
        first, first_finite, cache = question_fn.pure(
            graphdef, state, cache, sharding.shard_batch(q_tokens, mesh), sharding.shard_batch(q_pos, mesh),
            jax.random.fold_in(k_prefill, 1), plan=plan, sampling=sampling,
        )
        first.block_until_ready()
        ends = ends + np.asarray([len(q) for q in questions], np.int32)
    t1 = time.perf_counter()
    next_pos = sharding.shard_batch(jnp.asarray(ends), mesh)
    reporter = next(_next_reporter)
    if progress is not None:
        _reporters[reporter] = progress
    try:
        out, steps, nonfinite, cache = decode_fn.pure(
            graphdef, state, cache, first, first_finite, next_pos, k_decode,
            jnp.asarray(eos_array(eos)), jnp.int32(max_new_tokens), jnp.int32(pad), jnp.int32(reporter),
            plan=plan, sampling=sampling, buffer=buffer,
            progress=progress is not None,
        )
        out = np.asarray(out)[:, :max_new_tokens]
        if progress is not None:
            jax.effects_barrier()  # every tick delivered before the reporter is dropped
    finally:
        _reporters.pop(reporter, None)
    t2 = time.perf_counter()
    check_finite_steps(np.asarray(nonfinite))
    is_eos = np.isin(out, eos)
    lengths = np.where(is_eos.any(1), is_eos.argmax(1) + 1, max_new_tokens)
    return Generation(
        tokens=out,
        lengths=lengths,
        cache=cache,
        prompt_bucket=bucket,
        room=room,
        prefill_s=shared_s + t1 - t0,
        decode_s=t2 - t1,
        decode_steps=int(steps) - 1,
        held_bytes=held,
        full_bytes=full,
    )
