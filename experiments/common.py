"""Shared command-line pieces: model resolution and --policy options for every experiment."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvjax.policies import REGISTRY, Policy, make_policy

RANDOM_DEFAULT_DIR = Path.home() / ".cache" / "kvjax" / "random-tiny-llama"


def add_policy_args(p: argparse.ArgumentParser, default: str = "streaming") -> None:
    p.add_argument("--policy", default=default, choices=sorted(REGISTRY), help="cache policy")
    p.add_argument("--budget", type=int, default=256, help="cache slots per layer and KV head")
    p.add_argument("--sinks", type=int, default=4, help="attention sinks (streaming)")
    p.add_argument("--positions", default="absolute", choices=["absolute", "rolling"])


def policy_from_args(args: argparse.Namespace) -> Policy:
    options = {"positions": args.positions}
    if args.policy == "streaming":
        options["sinks"] = args.sinks
    return make_policy(args.policy, None if args.policy == "full" else args.budget, **options)


def default_model_dir() -> tuple[Path, bool]:
    """The embedded default model: for now a tiny *randomly initialised* Llama, created on first use."""
    from models.tiny import is_random, make_random_checkpoint

    if not (RANDOM_DEFAULT_DIR / "model.safetensors").is_file():
        make_random_checkpoint(RANDOM_DEFAULT_DIR)
    return RANDOM_DEFAULT_DIR, is_random(RANDOM_DEFAULT_DIR)
