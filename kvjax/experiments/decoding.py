"""Long-generation fidelity of decode-time compression: what evicting while generating costs, step by step.

    python -m kvjax.experiments.decoding [--model smollm2] [--new-tokens 1024] [--ratios 4,8]
        [--compare full,streaming,h2o,snapkv,knorm,triattention,rkv] [--prompts 3] [--prompt-len 512]

Prompts are windows of the held-out text the perplexity suite reads (`perplexity.heldout_text`). For each prompt the
full cache's greedy continuation of `--new-tokens` tokens is the reference. Each policy is then scored, on the same
prompt, by:

* KL(p_full || p_policy) of the next-token distributions at every step, and the NLL of the reference continuation,
  teacher-forced (`kvjax.fidelity.forced`: both caches read the same tokens);
* the tokens its own greedy output matches the reference for before it first differs;
* the bytes its cache holds (`nbytes` of the cache's arrays after the generation, K and V apart from the rules'
  bookkeeping) and its decode tok/s on this machine (named in the table).

A ratio r sizes every policy to the same slots, `(prompt + new tokens) // r` per layer and KV head, so bytes match:
StreamingLLM and H2O hold that budget; a prompt compressor (SnapKV, KNorm, ...) runs as `Decoding(scorer,
every=--decode-slots)` (kvpress's `DecodingPress`, the cache ranked every N decode steps), R-KV and TriAttention as
they are registered, each with budget `slots - decode_slots` so that budget + decode slots = slots, and each with its
prompt compressed by its own score first (`prompt=scorer`: kvpress's `PrefillDecodingPress`; TriAttention's reference
keeps the prompt whole, which would hold more than the others). TriAttention protects its latest 32 tokens
(`TRI_WINDOW`; its reference's 128 is for budgets of 2048).
TriAttention's query centres are calibrated once on the model (`kvjax.policies.triattention.calibrate`) over the
training half of the same corpus; the policy's description carries their hash.

Verdicts: each policy against StreamingLLM at the same ratio, by its mean KL per prompt, paired over prompts (a
prompt's steps are one cluster: its mean is one sample), by the project's rule (`kvjax.experiments.verdicts`).
Records go to OUT/records.jsonl as each finishes (a rerun resumes), tables to OUT/results.{md,json}, the KL against
position per policy to OUT/results.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

from kvjax import cache as kvcache
from kvjax import fidelity, generate
from kvjax.cli import HelpFormatter
from kvjax.errors import InvalidInput
from kvjax.experiments import cli, driver
from kvjax.experiments.common import add_run_args, int_list, model_help, positive_int, suite_model
from kvjax.experiments.decoding_report import BIN
from kvjax.experiments.records import ResultLog
from kvjax.machine import machine
from kvjax.policies import FullCache, make_policy
from kvjax.policies.scored import ScoredPolicy
from kvjax.policies.decoding import Decoding
from kvjax.policies.triattention import QueryCentres, calibrate

DEFAULT_COMPARE = "full,streaming,h2o,snapkv,knorm,triattention,rkv"
CALIBRATION_TOKENS = 4096
# TriAttention's protected window here: its reference's 128 is for budgets of 2048, and at 8:1 of 1536 tokens the budget
# is 64
TRI_WINDOW = 32


def prompts_of(tok, n: int, length: int) -> list[list[int]]:
    """`n` windows of `length` tokens, evenly spaced over the held-out text."""
    from kvjax.experiments.perplexity import heldout_text

    ids = tok(heldout_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < n * length:
        raise InvalidInput(f"--prompts {n} x --prompt-len {length} exceed the held-out text ({len(ids)} tokens)")
    step = len(ids) // n
    return [ids[i * step: i * step + length] for i in range(n)]


def centres_for(lm) -> QueryCentres:
    """TriAttention's query centres of `lm` over the first `CALIBRATION_TOKENS` tokens of the corpus' training half
    (deterministic: a rerun computes the same ones, and the policy's description carries their hash)."""
    from kvjax.experiments import corpus

    text = "\n\n".join(t for _, t in corpus.doc_documents("train"))
    return calibrate(lm.model, lm.tokenizer(text, add_special_tokens=False)["input_ids"][:CALIBRATION_TOKENS])


def policy_at(name: str, slots: int, decode_slots: int, centres: QueryCentres | None):
    """`name` holding `slots` per layer and KV head (the module docstring)."""
    if name == "full":
        return FullCache()
    if name in ("triattention", "rkv"):
        extra = {"centres": centres, "observation_window": TRI_WINDOW} if name == "triattention" else {}
        policy = make_policy(name, slots - decode_slots, decode_slots=decode_slots, **extra)
    elif isinstance(make_policy(name, slots), ScoredPolicy):
        policy = Decoding(scorer=make_policy(name, slots - decode_slots), every=decode_slots)
    else:
        policy = make_policy(name, slots)
        if not policy.evicts_while_decoding:
            raise InvalidInput(f"--compare {name}: it compresses a prompt once and then only appends, so a "
                               "generation grows it without bound")
        return policy
    # the prompt compressed by the same score, so the cache is budget + decode slots from the start (bytes match)
    return dataclasses.replace(policy, prompt=policy.scorer)


def nbytes(cache) -> tuple[int, int]:
    """(K and V bytes, all bytes) of a cache's arrays (`kvjax.cache.nbytes`): what it allocates, not only its slots
    holding a token. A head-wise or quantized cache (no `k` / `v` of its own) counts its groups' or codes' arrays."""
    total = kvcache.nbytes(cache)
    try:
        kv = sum(x.nbytes for layer in cache for x in (layer.k, layer.v))
    except AttributeError:
        kv = total
    return int(kv), int(total)


def measure(lm, prompt, reference, policy, new: int) -> dict:
    """One policy on one prompt: the teacher-forced KL and NLL, its own greedy output's agreement, bytes and speed."""
    f = fidelity.forced(lm.model, prompt, reference, policy)
    gen = generate(lm.model, [prompt], policy, max_new_tokens=new, eos_ids=[])
    own = gen.tokens[0, :new]
    differ = np.flatnonzero(own != np.asarray(reference[:new]))
    kv, total = nbytes(gen.cache)
    bins = [float(f["kl"][i: i + BIN].mean()) for i in range(0, new, BIN)]
    return {"kl": float(f["kl"].mean()), "kl_bins": bins, "nll": float(f["nll"].mean()),
            "nll_full": float(f["nll_full"].mean()), "agree": int(differ[0]) if differ.size else new,
            "kv_bytes": kv, "bytes": total, "tok_s": float(gen.decode_tokens_per_s)}


def suite(lm, out, *, compare: list[str], ratios: list[int], new_tokens: int = 1024, prompts: int = 3,
          prompt_len: int = 512, decode_slots: int = 128, progress: bool = True) -> driver.SuiteResult:
    """The fidelity of each policy of `compare` at each ratio over `prompts` prompts (the module docstring)."""
    for name, v in (("new_tokens", new_tokens), ("prompts", prompts), ("prompt_len", prompt_len),
                    ("decode_slots", decode_slots)):
        driver.positive(v, name)
    out = Path(out)
    total = prompt_len + new_tokens
    if total > lm.model.cfg.max_position_embeddings:
        raise driver.ArgumentError(f"prompt_len={prompt_len} + new_tokens={new_tokens} exceed the model's "
                                   f"max_position_embeddings={lm.model.cfg.max_position_embeddings}")
    texts = prompts_of(lm.tokenizer, prompts, prompt_len)
    centres = centres_for(lm) if "triattention" in compare else None
    policies = {"full": FullCache()}
    for r in ratios:
        for name in (n for n in compare if n != "full"):
            if total // r - decode_slots < 1:
                raise driver.ArgumentError(f"ratios={r} leaves {total // r} slots, no budget beside "
                                           f"decode_slots={decode_slots}")
            try:
                policies[f"{name} {r}:1"] = policy_at(name, total // r, decode_slots, centres)
            except InvalidInput as err:
                raise driver.ArgumentError(f"compare={name} at ratios={r} ({total // r} slots, decode_slots="
                                           f"{decode_slots}): {err}") from None
    cells = [(lab, i) for lab in policies for i in range(prompts)]  # the full cache first: it is the reference
    rid = lambda cell: f"{policies[cell[0]].describe()}|{cell[1]}"  # noqa: E731
    log_path = out / "records.jsonl"

    def run(batch):
        for lab, i in batch:
            if lab == "full":
                gen = generate(lm.model, [texts[i]], FullCache(), max_new_tokens=new_tokens, eos_ids=[])
                reference = gen.tokens[0, :new_tokens].tolist()
            else:
                reference = next(r["reference"] for r in ResultLog(log_path) if r["label"] == "full"
                                 and r["prompt"] == i)
            rec = measure(lm, texts[i], reference, policies[lab], new_tokens)
            yield {"id": rid((lab, i)), "label": lab, "policy": policies[lab].describe(), "prompt": i,
                   "ratio": None if lab == "full" else int(lab.rsplit(" ", 1)[1].split(":")[0]),
                   "machine": machine(), **rec, **({"reference": reference} if lab == "full" else {})}

    options = {"new_tokens": new_tokens, "prompts": prompts, "prompt_len": prompt_len, "decode_slots": decode_slots}
    ids = {rid(c) for c in cells}  # this run's cells only: a log may hold other ratios' or policies' records
    report = lambda log: write_report(out, [r for r in log if r["id"] in ids])  # noqa: E731
    return driver.run_suite(driver.Suite("decoding", "records.jsonl", cells, rid, run, report), out, lm, options,
                            policies, progress=progress)


def write_report(out: Path, records: list[dict]) -> tuple[str, dict, list[Path]]:
    """(markdown, JSON summary, [the plot]) of the records."""
    from kvjax.experiments.decoding_report import plot, table

    text, summary = table(records)
    return text, summary, [plot(out, records)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.decoding", description=cli.description(__doc__),
                                formatter_class=HelpFormatter)
    p.add_argument("--model", help=model_help("the embedded default model"))
    p.add_argument("--compare", default=DEFAULT_COMPARE, help="comma-separated policies (the module docstring says "
                                                              "how each is sized)")
    p.add_argument("--ratios", type=int_list, default=[4, 8], help="compression ratios: slots = (prompt + new) // r")
    p.add_argument("--new-tokens", type=positive_int, default=1024, help="tokens generated after each prompt")
    p.add_argument("--prompts", type=positive_int, default=3, help="prompts (windows of the held-out text)")
    p.add_argument("--prompt-len", type=positive_int, default=512, help="tokens per prompt")
    p.add_argument("--decode-slots", type=positive_int, default=128,
                   help="the decode-time policies' slots beyond their budget (compressed every this many tokens)")
    p.add_argument("--out", default="results/decoding", help="where the results go (a rerun with the same options "
                                                              "resumes there)")
    add_run_args(p)
    args = p.parse_args(argv)
    lm = suite_model(args)
    res = driver.call(p, suite, lm, args.out, compare=args.compare.split(","), ratios=args.ratios,
                      new_tokens=args.new_tokens, prompts=args.prompts, prompt_len=args.prompt_len,
                      decode_slots=args.decode_slots)
    print(res.table)
    print(f"wrote {res.out}/results.{{md,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
