"""The one place where a model meets `jax.jit`: split outside, merge inside, donate what is replaced.

Every compiled call into a model (generation's prompt pass, question and decode loop, scoring, few-shot
extension, KVzip's replay, the gate's evaluation) is a function of the model written with `@compiled(...)`. The
model is split at the call into a static structure and its arrays (`kvjax.structure`), and rebuilt inside the one
`jax.jit`, so the compiled program is pure in `(structure, arrays)` and a model with the same structure reuses it.
One convention for both kinds of model kvjax drives: a Flax NNX module and any registered pytree. The structure is
the key: the tree, the class of every node and the class's forward, so two classes of one pytree structure (equal
treedefs, in jax) never share a program. The arguments named
in `donate` (a cache the call replaces) are updated in place. What may vary between calls without a new
compilation are arrays (lengths, counts, token ids); what is static (`static`: a sized plan, sampling settings,
buffer sizes) is part of the compiled key.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import sys
from collections.abc import Callable, Sequence

import jax
import numpy as np

from kvjax import drive, sharding
from kvjax.structure import merge, split  # noqa: F401  (re-exported: the model's halves)

# Token counts that vary between calls are padded to buckets, so a new length compiles only at a new bucket.
MIN_BUCKET = 16


def bucket_length(n: int, min_bucket: int = MIN_BUCKET) -> int:
    """Smallest power of two >= n (and >= min_bucket)."""
    return max(min_bucket, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _tracing() -> bool:
    """Whether this runs inside a jit / vmap trace (a compiled call made from another)."""
    return isinstance(jax.numpy.zeros(()), jax.core.Tracer)  # every op is staged inside a trace


def compiled(static: Sequence[str] = (), donate: Sequence[str] = ()) -> Callable:
    """Decorator: `fn(model, *arrays, **static)` becomes one jitted program of `(graphdef, state, ...)`.

    The wrapped function takes the model (or `split(model)`'s halves via `.pure`, for callers that split once,
    e.g. to place the state on a mesh) and exposes the jitted program as `.pure`."""

    def wrap(fn: Callable) -> Callable:
        @functools.partial(jax.jit, static_argnames=tuple(static), donate_argnames=tuple(donate))
        def jitted(graphdef, state, *args, **kwargs):
            return fn(merge(graphdef, state), *args, **kwargs)

        def on_mesh(method):
            # Parameters placed on a mesh (kvjax.sharding.shard_model): traced with that mesh set, so the Pallas
            # kernels run per shard (`kvjax.attention.per_shard`) instead of being left to XLA, which cannot
            # partition them.
            @functools.wraps(method)
            def call(graphdef, state, *args, **kwargs):
                _look_after_compiles(state)
                mesh = sharding.mesh_of(state)
                # set once, from outside any trace (`jax.set_mesh` refuses to be entered inside one)
                keep = mesh is None or not jax.sharding.get_abstract_mesh().empty or _tracing()
                with contextlib.nullcontext() if keep else jax.set_mesh(mesh):
                    return method(graphdef, state, *args, **kwargs)

            return call

        pure = on_mesh(jitted)
        pure.lower, pure.trace = on_mesh(jitted.lower), on_mesh(jitted.trace)

        @functools.wraps(fn)
        def call(model, *args, **kwargs):
            graphdef, state = split(model)
            return pure(graphdef, state, *args, **kwargs)

        call.pure = pure
        return call

    return wrap


def mapped_regions() -> tuple[int, int] | None:
    """(memory regions this process maps, the kernel's limit on them: `vm.max_map_count`), or None where the system
    does not say (not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            n = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return n, int(f.read())
    except (OSError, ValueError):
        return None


_released = False  # whether the note below was printed in this process

# The share of `vm.max_map_count` past which compiled programs are dropped. The count is looked at after every
# compile (`_look_after_compiles`), so the room above it need only hold what one program maps: a 30-layer SmolLM2
# program maps a few hundred regions, and 15 % of the default limit is 9,800. A lower share dropped the programs a
# run goes on needing: the RULER section's 25 policies map about 34,000 regions for one batch of prompts and
# reuse every program in the next, so at half the limit each batch recompiled (or reloaded and retraced) them all.
MAP_SHARE = 0.85


def release_programs_near_map_limit(share: float = MAP_SHARE) -> bool:
    """Drops jax's compiled programs (`jax.clear_caches`) once this process maps more than `share` of the regions
    Linux allows it; returns whether it did.

    XLA's CPU backend maps each compiled kernel's code into memory regions of its own and keeps them while jax caches
    the program: a 30-layer program holds hundreds, and a run that compiles thousands of programs (a report's suites,
    the RULER section's shared passes) reaches `vm.max_map_count` (65,530 by default), where LLVM fails to allocate
    and the process dies with a segmentation fault. Dropped programs free their regions; a later call compiles again,
    or reads the persistent compilation cache. Results do not change. Called by the next compiled call after any
    compile (`_look_after_compiles`), between a suite's batches (`kvjax.experiments.driver.fill`) and between a report's
    sections."""
    global _released
    got = mapped_regions()
    if got is None or got[0] <= share * got[1]:
        return False
    jax.clear_caches()
    gc.collect()  # the executables go with their last reference
    if not _released:
        _released = True
        print(f"note: compiled programs held {got[0]:,} of the {got[1]:,} memory regions Linux allows a process "
              "(vm.max_map_count); dropped them to stay under it (they recompile, or load from the compile cache, "
              "when next needed)", file=sys.stderr)
    return True


_compiles_unseen = False  # a program was compiled (or loaded from the persistent cache) since the last look


def _on_compile(event: str, duration: float, **kwargs) -> None:
    # jax times every compile under this event, a load from the persistent compilation cache included: both map
    # the program's kernels. Only noted here; a compile's listener must not drop the caches it is filling.
    global _compiles_unseen
    if event == BACKEND_COMPILE_EVENT:
        _compiles_unseen = True


BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch's name for the event
jax.monitoring.register_event_duration_secs_listener(_on_compile)


def _look_after_compiles(state) -> None:
    """Before a compiled call with the model's arrays `state`: if anything was compiled since the last look, the
    mapped regions are counted (reading /proc/self/maps takes milliseconds, so once per compile, not once per call)
    and the programs dropped past `MAP_SHARE`. Not inside a trace (traced arrays), whose outer program is being
    built; told from the arrays, not by running an op, which a compile-only backend (libtpu's topologies) cannot."""
    global _compiles_unseen
    if _compiles_unseen and not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
        _compiles_unseen = False
        release_programs_near_map_limit()


@compiled(static=("plan",))
def prefill(model, tokens, positions, *, plan):
    """`kvjax.drive.prompt`: the last position's logits and the compressed cache. Keyed by the sized plan (each
    layer's slot counts), not by `max_len` itself: a policy whose slot counts do not depend on the room after the
    prompt (StreamingLLM's and H2O's rings) compiles once for any number of tokens to generate; one that reserves a
    slot per new token (FullCache, SnapKV & co) compiles once per room (`kvjax.generate` rounds it up to a power of
    two)."""
    return drive.prompt(model, tokens, positions, plan)


@compiled(static=("plan",), donate=("cache",))
def decode(model, tokens, positions, cache, *, plan):
    """`kvjax.drive.decode`: one token per row through the cache, which is replaced. Keyed by the sized plan the
    cache was made for."""
    return drive.decode(model, tokens, positions, cache, plan)


@compiled(static=("plan", "all_logits"), donate=("cache",))
def chunk(model, tokens, positions, cache, *, plan, all_logits=False):
    """`kvjax.drive.chunk`: one chunk of a chunked prompt; its logits (the last, or all) and the cache, replaced.
    Keyed by the sized plan, so every prompt whose plan is the same (a budget policy's, at any prompt length) shares
    one compiled step."""
    return drive.chunk(model, tokens, positions, cache, plan, all_logits)


@compiled(static=("plan",), donate=("cache",))
def size_rows(model, cache, positions, *, plan):
    """`kvjax.drive.size_rows` (the model is unused: every compiled call takes one)."""
    del model
    return drive.size_rows(plan, cache, positions)


def chunks(model, tokens, positions, plan, *, all_logits: bool = False, each=None):
    """A prompt read chunk by chunk (`prefill_mode="chunked"`) as a host loop over one compiled chunk step: the same
    cache as `kvjax.drive.prompt`'s scan, but one compilation for every prompt length and nothing on the device
    that grows with the prompt (the ids stay on the host). `tokens`, `positions`: `[b, t]`, left padded (positions
    -1); `plan`: the sized plan. `each(s, logits)`: called after the chunk starting at column `s` of the padded
    prompt (a scorer reads every chunk's logits, `all_logits`; a reader only the last). Returns the last chunk's
    logits, the cache, and the left padding added."""
    tokens, positions = np.asarray(tokens), np.asarray(positions)
    b, t = tokens.shape
    # No chunk reads more than the model's window (a chunk past the prompt reads it whole either way): an absurd
    # chunk (10**5, 10**9) is capped there instead of padding the prompt to its size; every prompt bucket still
    # shares one compiled chunk step
    n = min(plan.policy.chunk, model.cfg.max_position_embeddings)
    pad = -t % n
    tokens = np.pad(tokens, ((0, 0), (pad, 0)))
    positions = np.pad(positions, ((0, 0), (pad, 0)), constant_values=-1)
    cache = drive.empty_cache(model, plan, b)
    # What depends on a row's whole prompt (RazorAttention's L = max(S0, N / C)) is set before the first chunk, as
    # `drive.prompt`'s scan sets it. From each row's last position only, as a `[b, 1]` array, so that prompts of
    # every bucket share one compiled step: a chunked prefill takes no ratio budget (refused), the one rule that
    # would read more than the prompt's length.
    cache = size_rows(model, cache, positions.max(axis=1, keepdims=True), plan=plan)
    graphdef, state = split(model)
    logits = None
    for s in range(0, t + pad, n):
        logits, cache = chunk.pure(graphdef, state, tokens[:, s:s + n], positions[:, s:s + n], cache, plan=plan,
                                   all_logits=all_logits)
        if each is not None:
            each(s, logits)
    return logits, cache, pad
