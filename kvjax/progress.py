"""Progress bars for long work: rates and ETAs that exclude compile time, and bars that degrade off a terminal.

A suite's first cell compiles its programs: a rate measured over it (tqdm's) promised 37 minutes for a 25-second run.
`Bar` measures its rate from the end of the first unit on, so the ETA is "?" until a second unit is done, and then
the steady state's; the elapsed time still counts from the start. Off a terminal (a log file, CI), a bar drawn
under another one (`nested=True`) is not drawn: tqdm's nested bars move the cursor there (`ESC[A` in the log). The
outer bar still counts.
"""

from __future__ import annotations

import sys

from tqdm import tqdm
from tqdm.std import EMA


class Bar(tqdm):
    """tqdm whose rate starts after the first finished unit (its compile excluded); elapsed time from the start."""

    _warm = False  # whether the first unit is done (class defaults: tqdm displays from its own __init__)
    _before = 0.0  # seconds spent before the rate's clock started (the first unit)

    def __init__(self, *args, nested: bool = False, **kwargs):
        if nested and not _on_terminal(kwargs.get("file")):
            kwargs["disable"] = True
        super().__init__(*args, **kwargs)

    def update(self, n: int | float = 1):
        if self.disable:
            return super().update(n)
        shown = super().update(n)
        if not self._warm and self.n > self.initial:
            self._warm = True
            now = self._time()
            self._before = now - self.start_t
            # the rate's clock restarts here; EMAs forget the first unit's interval
            self.start_t = self.last_print_t = now
            self.initial, self.last_print_n = self.n, self.n
            self._ema_dn, self._ema_dt = EMA(self.smoothing), EMA(self.smoothing)
        return shown

    @property
    def format_dict(self):
        d = super().format_dict
        if isinstance(d, dict) and "elapsed" in d:
            d = {**d, "elapsed": d["elapsed"] + self._before}
            if self._warm and d.get("rate") is None:
                since = max(self._time() - self.start_t, 1e-9)
                d["rate"] = (self.n - self.initial) / since if self.n > self.initial else None
        return d


def _on_terminal(file) -> bool:
    stream = file if file is not None else sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def bar(total: int | None = None, *, desc: str | None = None, unit: str = "it", nested: bool = False,
        disable: bool = False, initial: int = 0, leave: bool = True, file=None) -> Bar:
    """A progress bar over `total` units (`Bar`); `nested`: drawn under another bar (not drawn off a terminal)."""
    return Bar(total=total, desc=desc, unit=unit, nested=nested, disable=disable, initial=initial,
               leave=leave and not nested, file=file)


__all__ = ["Bar", "bar"]
