"""TriAttention's query centres of a model, written to a file for `--policy triattention --centres FILE`.

    python -m kvjax.experiments.calibrate_triattention [--model DIR] --out centres.npz [--text FILE] [--tokens N]

One forward pass over a calibration text (default: the training half of the English documentation every Python
installation has, `kvjax.experiments.corpus`, never a suite's held-out prompts) records, per layer and query head, the
mean pre-RoPE query of each RoPE frequency and the mean of its magnitude (`kvjax.policies.triattention.calibrate`, as
the reference's `scripts/calibrate.py`), and each layer's RoPE frequencies. The file is written whole, then renamed
into place; its hash names it in every policy description that reads it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvjax.cli import HelpFormatter
from kvjax.errors import InvalidInput
from kvjax.experiments import cli, driver
from kvjax.experiments.common import add_run_args, model_help, positive_int, suite_model
from kvjax.policies.triattention import calibrate


def calibration_ids(tok, text: str | None, tokens: int) -> list[int]:
    """The first `tokens` token ids of `text` (a file's path), or of the corpus' training documentation."""
    if text is None:
        from kvjax.experiments import corpus

        body = "\n\n".join(t for _, t in corpus.doc_documents("train"))
    else:
        try:
            body = Path(text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise InvalidInput(f"--text {text}: cannot be read as UTF-8 text ({err})") from None
    ids = tok(body, add_special_tokens=False)["input_ids"][:tokens]
    if len(ids) < 2:
        raise InvalidInput(f"--text {text}: fewer than 2 tokens")  # the corpus always has more
    return ids


def write(model, ids, out: str):
    """The centres of `model` over `ids`, saved to `out`; an unwritable path is the user's error."""
    centres = calibrate(model, ids)
    try:
        centres.save(out)
    except OSError as err:
        raise InvalidInput(f"--out {out}: cannot be written ({err.strerror or err})") from None
    return centres


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvjax.experiments.calibrate_triattention",
                                description=cli.description(__doc__), formatter_class=HelpFormatter)
    p.add_argument("--model", help=model_help("the embedded default model"))
    p.add_argument("--out", required=True, help="the centres file to write (.npz)")
    p.add_argument("--text", help="a UTF-8 text file to calibrate on (default: the corpus' training documentation)")
    p.add_argument("--tokens", type=positive_int,
                   help="calibration tokens (the text's first); default 4096, or the model's context if shorter")
    add_run_args(p)
    args = p.parse_args(argv)
    lm = suite_model(args)
    context = lm.model.cfg.max_position_embeddings
    args.tokens = args.tokens or min(4096, context)
    if args.tokens > context:
        p.error(f"--tokens {args.tokens} exceeds the model's max_position_embeddings={context}")
    ids = driver.call(p, calibration_ids, lm.tokenizer, args.text, args.tokens)
    centres = driver.call(p, write, lm.model, ids, args.out)
    print(f"wrote {args.out}: {centres!r}, {len(ids)} calibration tokens, {centres.mean_re.shape[0]} layers x "
          f"{centres.mean_re.shape[1]} query heads x {centres.mean_re.shape[2]} frequencies")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
