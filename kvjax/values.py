"""Command-line values, parsed and checked where they are read: a bad one is refused naming the flag (argparse's
`type`). The policies declare their options' parsers with these (`kvjax.policies.options`), and every entry point
uses them."""

from __future__ import annotations

import argparse
import math


def _number(kind, text: str, what: str, ok) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    # NaN fails every comparison, so `ok` states what is valid, never what is not.
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"{text} must be {what}")
    return value


def positive_int(text: str) -> int:
    return _number(int, text, ">= 1", lambda x: x >= 1)


def nonnegative_int(text: str) -> int:
    return _number(int, text, ">= 0", lambda x: x >= 0)


def odd_positive_int(text: str) -> int:
    """A pooling kernel: odd, so that `kernel // 2` padding on each side keeps one score per token."""
    return _number(int, text, "a positive odd number (pooling keeps the length only for odd kernels)",
                   lambda x: x >= 1 and x % 2 == 1)


def nonnegative_float(text: str) -> float:
    return _number(float, text, "a finite number >= 0", lambda x: x >= 0)


def positive_float(text: str) -> float:
    return _number(float, text, "a finite number > 0", lambda x: x > 0)


def finite_float(text: str) -> float:
    return _number(float, text, "a finite number", lambda x: True)


def probability(text: str) -> float:
    """top-p: in (0, 1]."""
    return _number(float, text, "in (0, 1]", lambda x: 0 < x <= 1)


def fraction_removed(text: str) -> float:
    """--ratio: the fraction of the prompt removed, in [0, 1)."""
    return _number(float, text, "in [0, 1) (the fraction of the prompt removed)", lambda x: 0 <= x < 1)


def int_list(text: str) -> list[int]:
    """`4096,8192`: positive integers."""
    return [positive_int(x) for x in text.split(",") if x.strip()] or _empty(text)


def float_list(text: str) -> list[float]:
    return [_number(float, x, "a finite number", lambda v: True) for x in text.split(",") if x.strip()] or \
        _empty(text)


def _empty(text: str):
    raise argparse.ArgumentTypeError(f"{text!r} holds no values")


__all__ = ["finite_float", "float_list", "fraction_removed", "int_list", "nonnegative_float", "nonnegative_int",
           "odd_positive_int", "positive_float", "positive_int", "probability"]
