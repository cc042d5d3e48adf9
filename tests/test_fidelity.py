"""`kvjax.fidelity.forced` (the decoding suite's per-step KL and NLL) against transformers and kvpress: the full
cache's NLL of a continuation is transformers' teacher-forced NLL, and a decode-time policy's KL and NLL are those
of kvpress 0.5.5's `DecodingPress` fed the same tokens."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax import fidelity
from kvjax.models import load
from kvjax.policies import Decoding, KNorm

torch = pytest.importorskip("torch")
kvpress = pytest.importorskip("kvpress")

T, STEPS, BUDGET, EVERY = 60, 30, 40, 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from tests.conftest import hf_llama

    pt, path = hf_llama(tmp_path_factory.mktemp("fidelity"), init_range=0.2, vocab_size=257,
                        attn_implementation="eager")
    return pt, load(path).model


def _teacher_forced(pt, ids, press=None):
    """transformers' next-token log-probabilities after the prompt and after each forced token: `[STEPS, V]`."""
    from transformers import DynamicCache

    cache, out = DynamicCache(), []
    with torch.no_grad(), (press(pt) if press is not None else torch.no_grad()):
        logits = pt(torch.tensor(ids[None, :T]), past_key_values=cache).logits[0, -1]
        for t in range(T, T + STEPS):
            out.append(torch.log_softmax(logits.double(), -1).numpy())
            logits = pt(torch.tensor([[ids[t]]]), past_key_values=cache, position_ids=torch.tensor([[t]])).logits[0, -1]
    return np.stack(out)


def test_fidelity_of_a_decode_time_policy_is_kvpress_decoding_press_teacher_forced(pair):
    pt, model = pair
    ids = np.random.RandomState(3).permutation(257)[:T + STEPS]  # distinct ids: no KNorm ties
    full = _teacher_forced(pt, ids)
    theirs = _teacher_forced(pt, ids, kvpress.DecodingPress(base_press=kvpress.KnormPress(),
                                                            compression_interval=EVERY, target_size=BUDGET))
    ours = fidelity.forced(model, ids[:T].tolist(), ids[T:].tolist(), Decoding(scorer=KNorm(budget=BUDGET),
                                                                                every=EVERY))
    target = ids[T:]
    np.testing.assert_allclose(ours["nll_full"], -full[np.arange(STEPS), target], atol=2e-4)
    np.testing.assert_allclose(ours["nll"], -theirs[np.arange(STEPS), target], atol=2e-4)
    kl = np.sum(np.exp(full) * (full - theirs), axis=-1)
    np.testing.assert_allclose(ours["kl"], kl, atol=2e-4)
    # step i's distribution follows i decoded tokens; the first compression runs after the EVERY-th one's attention
    assert kl[: EVERY + 1].max() < 1e-9 and kl[EVERY + 1:].min() > 1e-4
