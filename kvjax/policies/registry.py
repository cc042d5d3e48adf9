"""The methods by `--policy` name: kvjax's own (registered in their modules, `kvjax.policies.options.register`) and
a researcher's own policy class named `module:Class` on a command line, imported and registered with its fields'
options."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Mapping

from kvjax.errors import InvalidInput
from kvjax.policies import options
from kvjax.policies.base import Policy


def method(name: str) -> options.Method:
    """The method `--policy name` builds: a registered name, or a user's own policy class as `module:Class` (imported;
    its options are its fields')."""
    found = options.methods()
    if name in found:
        return found[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise InvalidInput(f"--policy {name}: cannot import {attr} from {module} ({err})") from None
        if not (inspect.isclass(cls) and issubclass(cls, Policy) and dataclasses.is_dataclass(cls)):
            raise InvalidInput(f"--policy {name}: {attr} is not a policy class (a frozen dataclass subclassing "
                               "kvjax.policies.LayerPolicy)")
        # the class itself registered when its module was imported (not a registered base: a subclass is its own)
        registered = cls.__dict__.get("registered_as")
        if registered in options.methods():
            return options.methods()[registered]
        options.register(name, paper="(your own)", docs=None,
                         budget="budget" in {f.name for f in dataclasses.fields(cls)})(cls)
        return options.methods()[name]
    raise InvalidInput(f"unknown policy {name!r}; available: {sorted(found)} (or a class of your own: "
                       "--policy my_module:MyRule)")


class Registry(Mapping):
    """`--policy` name -> `Method`, live over `methods()`; a user's class `module:Class` is in it (imported)."""

    def __getitem__(self, name: str) -> options.Method:
        try:
            return method(name)
        except InvalidInput:
            raise KeyError(name) from None

    def __contains__(self, name) -> bool:
        try:
            method(name)
        except InvalidInput:
            return False
        return True

    def __iter__(self):
        return iter(options.methods())

    def __len__(self) -> int:
        return len(options.methods())


__all__ = ["Registry", "method"]
