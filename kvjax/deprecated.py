"""Renamed keywords: the old name still works, with a DeprecationWarning that names the new one.

Public names have one meaning each (MAT's `beta`, AnLLM's `anchor_slots`, the eq. 4 `anchor_mask`);
code written against an older kvjax keeps running and is told what to write instead.
"""

from __future__ import annotations

import functools
import warnings


def _translate(owner: str, renames: dict[str, str], kw: dict) -> dict:
    for old, new in renames.items():
        if old in kw:
            if new in kw:
                raise TypeError(f"{owner}: got both {old}= (deprecated) and {new}=; pass {new}= only")
            warnings.warn(f"{owner}: the keyword {old}= is deprecated; use {new}=", DeprecationWarning, stacklevel=3)
            kw[new] = kw.pop(old)
    return kw


def renamed_keywords(**renames: str):
    """A decorator for a function, or a (dataclass) class's `__init__`: `old=` is accepted as `new=`
    (`renames` maps old to new), with a DeprecationWarning at the caller's line."""

    def wrap(target):
        if isinstance(target, type):
            init = target.__init__

            @functools.wraps(init)
            def __init__(self, *args, **kw):
                init(self, *args, **_translate(target.__name__, renames, kw))

            target.__init__ = __init__
            return target

        @functools.wraps(target)
        def call(*args, **kw):
            return target(*args, **_translate(target.__qualname__, renames, kw))

        return call

    return wrap


def renamed_attribute(old: str, new: str) -> property:
    """A read-only property `old` that returns `new`, with a DeprecationWarning (for renamed fields)."""

    def get(self):
        warnings.warn(f"{type(self).__name__}.{old} is deprecated; use .{new}", DeprecationWarning, stacklevel=2)
        return getattr(self, new)

    return property(get, doc=f"Deprecated: `{new}`.")
