"""What a method gets from the driver once its prompt is cached: the model, the plan, the cache, the prompts and the
forwards a method may run over the cached context, handed to its hook `Policy.after_prompt(run)`, which returns
the plan and the cache decoding goes on with. The driver (`kvjax.generate`) calls the hook of every policy and
names none: KVzip's replays (`kvjax.policies.kvzip`) and the Attention-Gate's cut (`Policy.shrink`, the default hook)
are the methods' own.

    plan, cache = plan.policy.after_prompt(PromptPass(model, plan, cache, prompts, max_len, prompt_len))
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from kvjax import drive, engine
from kvjax.cache import Cache
from kvjax.engine import compiled
from kvjax.model import CachedLM
from kvjax.policies.base import Policy
from kvjax.policies.plan import Plan, resolve


@compiled(static=("plan", "plus"))
def replay_fn(model, tokens, positions, cache, span, *, plan, plus=False):
    return drive.replay(model, tokens, positions, cache, plan, span, plus)


@compiled(static=("plan",))
def grad_replay_fn(model, tokens, positions, cache, span, *, plan):
    return drive.grad_replay(model, tokens, positions, cache, plan, span)


@dataclasses.dataclass
class PromptPass:
    """One policy's prompt pass, as its `after_prompt` hook sees it. `prompts`: the rows' token ids (unpadded);
    `max_len` / `prompt_len`: the slots the plan was sized for and the padded prompt's; `memo`: a dict shared by the
    hooks of one generation over the same model and prompts (KVzip policies that differ only in how much they
    evict reuse each row's replay scores)."""

    model: CachedLM
    plan: Plan
    cache: Cache
    prompts: list[list[int]]
    max_len: int
    prompt_len: int
    memo: dict = dataclasses.field(default_factory=dict)

    def replay(self, tokens: np.ndarray, positions: np.ndarray, cache: Cache, span: np.ndarray, *, plus: bool = False,
               grad: bool = False) -> tuple:
        """Per layer, each slot's reconstruction score under a teacher-forced extension of the read-only `cache`
        (`kvjax.drive.replay`; `grad`: input x gradient, `kvjax.drive.grad_replay`). One compiled program per
        replay length."""
        graphdef, state = self._halves
        args = (graphdef, state, jnp.asarray(tokens), jnp.asarray(positions), cache, jnp.asarray(span))
        if grad:
            return grad_replay_fn.pure(*args, plan=self.plan)
        return replay_fn.pure(*args, plan=self.plan, plus=plus)

    @functools.cached_property
    def _halves(self):
        # the model split once per prompt pass, not once per replay (a context of 4K tokens is several replays)
        return engine.split(self.model)

    def resized(self, policy: Policy) -> Plan:
        """The plan of `policy` (the plan's policy changed by its hook: the gate cut to what it kept), sized as this
        pass's. `plan.policy` is already fitted to the model's windows: resolved as it is."""
        cfg = self.model.cfg
        return resolve(policy, cfg.num_layers, cfg.num_kv_heads).sized(self.max_len, self.prompt_len)


__all__ = ["PromptPass", "grad_replay_fn", "replay_fn"]
