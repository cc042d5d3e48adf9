"""Errors that are the caller's to fix, told apart from kvjax's own bugs.

Command-line tools print a `UserError` as one line (`error: ...`, exit code 2) and let every
other exception keep its traceback: a bad file or option is the user's to fix, anything else
is a bug to report. Each concrete class also derives from the builtin a caller would catch
(`ValueError`, `FileNotFoundError`, `FloatingPointError`), so API code keeps working.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the caller passed (a file, a value), explained by the message.

    `cli_message()` is the message for command-line users: subclasses whose advice names an
    API argument override it to name the command-line flag instead."""

    def cli_message(self) -> str:
        return str(self.args[0]) if self.args else str(self)  # KeyError's str() would add quotes


class InvalidInput(UserError, ValueError):
    """A value or a file's content that kvjax cannot use."""


class MissingFile(UserError, FileNotFoundError):
    """A file or directory that does not exist."""


class MissingKey(UserError, KeyError):
    """A name (a weight, a field) that a file should hold and does not."""


class NonFiniteError(UserError, FloatingPointError):
    """A NaN or an infinity in weights, logits or scores: never an output, always an error."""


class NonFiniteWeights(NonFiniteError):
    """A checkpoint tensor holding NaN or inf; the advice names `allow_nonfinite=True` to API callers
    and `--allow-nonfinite` on the command line."""

    def __init__(self, tensor: str, file, count: int):
        self.tensor, self.file, self.count = tensor, file, count
        super().__init__(self._message("allow_nonfinite=True"))

    def cli_message(self) -> str:
        return self._message("--allow-nonfinite")

    def _message(self, hint: str) -> str:
        return (f"weight {self.tensor!r} in {self.file} holds {self.count} non-finite values (NaN or inf); a model "
                f"with broken weights gives meaningless results. Pass {hint} to load it anyway")


class PromptTooLong(InvalidInput):
    """A prompt (plus the tokens to generate) longer than the model's positions allow.

    The advice is true for the caller: it never suggests what is already set, and names
    `truncate=True` to API callers and `--truncate` on the command line."""

    def __init__(self, longest: int, max_new: int, max_positions: int, *, absolute: bool, truncate: bool):
        self.longest, self.max_new, self.max_positions = longest, max_new, max_positions
        self.absolute, self.truncate = absolute, truncate
        super().__init__(self._message(truncate_hint="truncate=True", rolling_hint='positions="rolling"'))

    def cli_message(self) -> str:
        return self._message(truncate_hint="--truncate", rolling_hint="--positions rolling")

    def _message(self, truncate_hint: str, rolling_hint: str) -> str:
        what = f"prompt of {self.longest} tokens" + (f" + max_new_tokens={self.max_new}" if self.absolute else "")
        fixes = []
        if self.truncate:  # truncation is on, but leaves no room for a prompt
            left = self.max_positions - self.max_new
            fixes.append(f"generate fewer tokens (max_new_tokens={self.max_new} "
                         + (f"leaves {left} positions for the prompt)" if left > 0 else
                            f"leaves no positions for the prompt; at most {self.max_positions - 2} leave room for a "
                            "2-token prompt)"))
        else:
            fixes.append(f"pass {truncate_hint} (LongBench's middle truncation)")
        fixes.append("shorten the prompt")
        # Rolling positions keep decoded tokens' positions below the cache size, so they help
        # only when the prompt itself fits.
        if self.absolute and self.longest <= self.max_positions:
            fixes.append(f"use {rolling_hint}")
        return (f"{what} exceeds the model's max_position_embeddings={self.max_positions}; "
                + ", ".join(fixes[:-1]) + (" or " if len(fixes) > 1 else "") + fixes[-1])


def require_finite(values, what: str, step: str = "token"):
    """`values` (`[rows, steps]` or `[rows]`, array-like) if all finite; else `NonFiniteError` naming
    the first bad row and step, so a NaN never reaches a record or a table as a number."""
    import numpy as np

    arr = np.asarray(values)
    bad = ~np.isfinite(arr)
    if bad.any():
        idx = np.argwhere(bad)[0]
        where = f"row {idx[0]}" + (f", {step} {idx[1]}" if arr.ndim > 1 else "")
        raise NonFiniteError(f"non-finite {what} (NaN or inf) at {where} ({int(bad.sum())} values affected); "
                             "the model's numbers are broken (weights, dtype overflow): nothing was recorded")
    return values


__all__ = ["InvalidInput", "MissingFile", "MissingKey", "NonFiniteError", "NonFiniteWeights", "PromptTooLong", "UserError",
           "require_finite"]
