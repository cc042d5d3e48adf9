"""What every benchmark table shares (issue #64): repeated timings shown as their median with the min–max
spread, and the machine's load average before and after the run, with a CPU table refused on a busy machine.

    guard = timing.LoadGuard(args, cpu=jax.devices()[0].platform == "cpu")   # reads the load
    guard.check()                                   # a CPU run on a busy machine: one error line, exit 2
    s = timing.repeat(lambda: jax.block_until_ready(f()), repeats)          # seconds, after a warm-up call
    row |= s.fields("prefill_s")                    # prefill_s (the median), prefill_s_min, prefill_s_max
    timing.cell(row, "prefill_s")                   # "0.512 (0.498–0.530)"
    payload = guard.stamp(payload)                  # payload["load"]: before, after, cores, limit, machine
    lines = guard.mark(lines, repeats)              # the title marked if measured under load; a load line under

The limit: a CPU table is measured only when the 1-minute load average before the run is at most `--max-load`
(default half the cores): the run's own threads use every core (XLA's and PyTorch's pools), so other work on
more than half of them would slow it by a factor the table cannot show. `--allow-load` measures anyway and marks
the table MEASURED UNDER LOAD, in its title and JSON; so is a table whose load after the run exceeds the cores
plus that limit (something started beside it). GPU runs record the load but are never refused: the device does
the work.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvjax.errors import InvalidInput
from kvjax.machine import cores, machine  # noqa: F401  (re-exported: kvjax's suites name the machine too)

MARK = "MEASURED UNDER LOAD"


@dataclasses.dataclass(frozen=True)
class Spread:
    """Repeated measurements (seconds, or a rate): their median and their range."""

    samples: tuple[float, ...]

    def __post_init__(self):
        if not self.samples:
            raise ValueError("a spread of no measurement")

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def rate(self, work: float) -> Spread:
        """`work` per second of each sample (tokens/s from seconds): the slowest run is the lowest rate."""
        return Spread(tuple(work / s for s in self.samples))

    def fields(self, key: str) -> dict[str, float]:
        """`{key: median, key_min: ..., key_max: ...}` for a JSON row."""
        return {key: self.median, f"{key}_min": self.min, f"{key}_max": self.max}


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """(seconds, result) of one call; `fn` must block until its result is ready."""
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def repeat(fn: Callable[[], object], repeats: int, warmup: int = 1) -> Spread:
    """Seconds of `repeats` calls of `fn` (which blocks until done) after `warmup` untimed ones (compilation)."""
    if repeats < 1:
        raise InvalidInput(f"--repeats {repeats}: at least 1")
    for _ in range(warmup):
        fn()
    return Spread(tuple(timed(fn)[0] for _ in range(repeats)))


def read_bandwidth(nbytes: int = 2**30, repeats: int = 5) -> Spread:
    """The default device's streaming read rate in bytes/s: a compiled sum over an `nbytes` float32 array (1 GiB,
    larger than any CPU's caches), `repeats` times after a warm-up. Decoding one token per row reads every weight
    and the whole cache once, so this rate over those bytes bounds its speed (`decode_roofline`)."""
    import jax
    import jax.numpy as jnp

    x = jax.block_until_ready(jnp.ones((nbytes // 4,), jnp.float32))
    total = jax.jit(jnp.sum)
    return repeat(lambda: jax.block_until_ready(total(x)), repeats).rate(x.nbytes)


def decode_roofline(bandwidth: float, weight_bytes: int, cache_bytes: int) -> float:
    """Decode steps/s (tokens/s per row) if a step only read the weights once and the batch's whole cache once, at
    `bandwidth` bytes/s: the memory roofline of a decode step that computes little (batch 1 on a CPU or a GPU)."""
    return bandwidth / (weight_bytes + cache_bytes)


def cell(row: Mapping, key: str, fmt: str = ".3f", scale: float = 1.0) -> str:
    """A table cell: the median with its range, `0.512 (0.498–0.530)`, or the value alone where the row has no
    range (one repeat, or a row written before ranges were kept)."""
    if row.get(key) is None:
        return ""
    mid = format(row[key] * scale, fmt)
    lo, hi = row.get(f"{key}_min"), row.get(f"{key}_max")
    if lo is None or hi is None or lo == hi:
        return mid
    return f"{mid} ({format(lo * scale, fmt)}–{format(hi * scale, fmt)})"


def default_max_load() -> float:
    return 0.5 * cores()


def _load() -> tuple[float, float, float] | None:
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except (AttributeError, OSError):  # a platform without a load average
        return None


def add_load_args(parser: argparse.ArgumentParser) -> None:
    """--max-load and --allow-load, for a benchmark that writes a CPU table."""
    g = parser.add_argument_group("machine load (a CPU table is measured on a quiet machine)")
    g.add_argument("--max-load", type=float, default=None,
                   help="the highest 1-minute load average before the run at which a CPU table is measured; "
                   f"default half the cores ({default_max_load():g} here)")
    g.add_argument("--allow-load", action="store_true",
                   help=f"measure on a busier machine anyway: the table's title and JSON say {MARK}")


class LoadTooHigh(InvalidInput):
    """The machine is too busy for a CPU table to mean anything."""


class LoadGuard:
    """The load average around one benchmark run (read when made), and the decision about its table."""

    def __init__(self, args: argparse.Namespace, *, cpu: bool):
        self.cpu, self.cores, self.allow = cpu, cores(), bool(getattr(args, "allow_load", False))
        limit = getattr(args, "max_load", None)
        self.max_load = default_max_load() if limit is None else float(limit)
        if self.max_load < 0:
            raise InvalidInput(f"--max-load {limit}: a load average is never negative")
        self.before = _load()

    def busy_before(self) -> bool:
        return self.cpu and self.before is not None and self.before[0] > self.max_load

    def check(self) -> None:
        """Refuses a CPU run that starts on a busy machine, unless --allow-load."""
        if self.busy_before() and not self.allow:
            raise LoadTooHigh(
                f"the 1-minute load average is {self.before[0]:.2f} on {self.cores} cores, above --max-load "
                f"{self.max_load:g}: a CPU table measured now would time other work too; wait for a quiet machine, "
                f"or pass --allow-load to write it marked {MARK}")

    def record(self) -> dict:
        """The load before the run and now, and whether the table was measured under load (and why)."""
        after = _load()
        why = []
        if self.busy_before():
            why.append(f"1-minute load {self.before[0]:.2f} before the run > {self.max_load:g}")
        if self.cpu and after is not None and after[0] > self.cores + self.max_load:
            why.append(f"1-minute load {after[0]:.2f} after the run > {self.cores} cores + {self.max_load:g}")
        return {"before": self.before, "after": after, "cores": self.cores, "max_load": self.max_load,
                "cpu": self.cpu, "machine": machine(), "under_load": bool(why), "why": "; ".join(why) or None}

    def stamp(self, payload: dict, record: dict | None = None) -> dict:
        """`payload` (a table's JSON) with its "load", and a "warning" where it was measured under load."""
        record = record or self.record()
        out = {**payload, "load": record}
        if record["under_load"]:
            out["warning"] = f"{MARK}: {record['why']}"
        return out

    def mark(self, lines: Sequence[str], repeats: int | None = None, record: dict | None = None) -> list[str]:
        """A table's markdown lines with the load line under them, and the title (the first line) marked where
        the table was measured under load."""
        record = record or self.record()
        lines = list(lines)
        if record["under_load"] and lines:
            title = lines[0].lstrip("# ")
            lines[0] = f"# {MARK} ({record['why']}): {title}"

        def fmt(load):
            return "n/a" if load is None else " / ".join(f"{x:.2f}" for x in load)

        note = (f"Load average (1 / 5 / 15 min) before the run {fmt(record['before'])}, after "
                f"{fmt(record['after'])}, on {record['machine']}")
        if self.cpu:
            note += (f"; a CPU table is measured only at a 1-minute load of at most {record['max_load']:g} before "
                     "the run")
        if repeats is not None:
            note += f". Times: the median of {repeats} timed run{'s' if repeats != 1 else ''} (min–max)"
        return [*lines, "", note + "."]



@contextlib.contextmanager
def rss_peak():
    """Yields a dict whose "bytes" is, after the block, the peak resident set size above the one at its
    start (Linux /proc; sampled every 5 ms by a thread), or None where /proc is missing."""
    out = {"bytes": None}
    statm = Path("/proc/self/statm")
    if not statm.is_file():
        yield out
        return
    page = os.sysconf("SC_PAGE_SIZE")
    rss = lambda: int(statm.read_text().split()[1]) * page  # noqa: E731
    base, peak, stop = rss(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield out
    finally:
        stop.set()
        t.join()
        out["bytes"] = max(peak[0], rss()) - base


__all__ = ["MARK", "LoadGuard", "LoadTooHigh", "Spread", "add_load_args", "cell", "cores", "default_max_load", "rss_peak",
           "repeat", "timed"]
