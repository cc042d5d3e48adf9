"""RULER's synthetic tasks, generated offline at any length with any tokenizer.

A reimplementation (no code copied) of NVIDIA/RULER's generators, read as specifications:
`scripts/data/synthetic/{niah,variable_tracking,common_words_extraction,freq_words_extraction,qa}.py`,
`scripts/synthetic.yaml` (the task table below) and `scripts/data/synthetic/constants.py`
(templates, answer prefixes, tokens to generate). What follows RULER exactly:

* the templates and answer prefixes, verbatim (as of RULER's 2025-05 fix of the typo "assgined" in VT's
  answer prefix), joined as RULER's
  `prepare.py` does for its "base" model template: `template + answer_prefix`;
* NIAH's singular rewrite when one value is asked (`Some` -> `A`, `are all` -> `is`, `are` -> `is`,
  `answers` -> `answer`, `numbers` -> `number`), needles, keys (`{adjective}-{noun}` from
  `wonderwords`' lists, 7-digit numbers, uuid4s), the noise and needle haystacks;
* VT's chains (five-letter names, values 10000-99998), its one-shot example (generated first at 500
  tokens with three-letter names and the value 12345, then renamed and revalued per sample);
* CWE's word lists (`wonderwords` nouns + adjectives + verbs), 10 common words x 30 and the rest x 3
  with a 40-word example (10 / 3) at 4K and above, x 6 / x 1 with a 20-word example (3 / 1) below;
* FWE's coded vocabulary (six lowercase letters, `(max_seq_length - tokens_to_generate) // 50` words, as
  RULER sizes it since it fits input + generation), counts
  `N k^-alpha / zeta(alpha)`, `...` as the top-ranked noise word, the answer its ranks 2-4;
* the fitting: binary search on the haystack size (upper bound 3x the estimate; CWE 2x) so that
  input tokens + tokens to generate fit the length, then per sample one haystack step less
  while a draw does not fit; the increments (25, or 5 below 4K; VT 10 / 5; CWE 10; essays 500);
* the seeds: one `random.Random(seed)` and one NumPy `RandomState(seed)` per task, drawn in RULER's
  order, and the fresh `random.Random(seed)` RULER uses for its shuffles (default seed 42);
* the input is split from its answer prefix where RULER splits it (`rfind` of the prefix's first
  10 characters);
* QA (qa_1 SQuAD 2.0, qa_2 HotpotQA, read from RULER's `squad.json` / `hotpotqa.json` in a local data
  directory): the dataset's answerable questions in order, each with its gold documents, its article's
  other paragraphs (SQuAD) and random others, shuffled by a fresh `Random(seed)`, numbered "Document i:";
  10 documents per step; scored by string_match_part. Byte-identical to RULER's qa.py on the same files
  (tests/data/ruler_qa; RULER seeds `random` before importing transformers, whose import draws from it, so
  RULER's own samples depend on the transformers install unless transformers is imported first).

Where kvjax differs, and why:

* token counts are of what the model reads: the tokenizer's ids with its special tokens (BOS),
  so "fits the length" holds for the prompt kvjax actually generates from (RULER counts
  `tokenizer.tokenize(text)`, without BOS);
* a sample that does not fit at the smallest haystack is drawn again, as RULER does, but at most 100 times,
  then raises a clear error (RULER's loop would spin forever); so does CWE
  beyond the 8166 distinct `wonderwords` words (RULER then reads its own `english_words.json`,
  which kvjax does not ship);
* the essay haystack (Paul Graham's essays in RULER) is the standard library's English reference
  text (`pydoc_data.topics`, held-out split), split into sentences by a regular expression (RULER
  uses nltk's punkt); those tasks carry the suffix `_stdlib`, as their scores are not RULER's.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import string
import uuid
from collections.abc import Callable
from functools import lru_cache

import numpy as np

from kvjax.errors import InvalidInput

# ---- scripts/data/synthetic/constants.py (verbatim) ----
TEMPLATES = {
    "niah": {
        "tokens_to_generate": 128,
        "template": "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                    "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
                    "magic {type_needle_v} for {query} mentioned in the provided text?",
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
                    "Question: Find all variables that are assigned the value {query} in the text above.",
        "answer_prefix": " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
                         "are assigned the value {query}, they are: ",
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": "Below is a numbered list of words. In these words, some appear more often than others. Memorize "
                    "the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the "
                    "above list?",
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": "Read the following coded text and track the frequency of each coded word. Find the three most "
                    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                    "ignore the dots '....'. What are the three most frequently appeared words in the above coded "
                    "text?",
        "answer_prefix": " Answer: According to the coded text above, the three most frequently appeared words are:",
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": "Answer the question based on the given documents. Only give me the answer and do not output any other "
                    "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
                    "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        "answer_prefix": " Answer:",
    },
}
# scripts/eval/synthetic/constants.py: QA counts a sample when any reference is found, the others the share found.
METRICS = {"niah": "all", "variable_tracking": "all", "common_words_extraction": "all", "freq_words_extraction": "all",
           "qa": "part"}
# RULER's QA files (scripts/data/synthetic/json/download_qa_dataset.sh): SQuAD 2.0's dev set and HotpotQA's dev
# set (distractor), as RULER names them in its json/ folder.
QA_FILES = {"squad": "squad.json", "hotpotqa": "hotpotqa.json"}
DOCUMENT = "Document {i}:\n{document}"

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]
DEFAULT_SEED = 42
REDRAWS = 100  # draws at the smallest haystack before a task is said not to fit (RULER draws forever)


@dataclasses.dataclass(frozen=True)
class Task:
    """One entry of RULER's synthetic.yaml: a generator (`kind`) and its arguments."""

    name: str
    kind: str  # niah | variable_tracking | common_words_extraction | freq_words_extraction
    args: tuple[tuple[str, object], ...] = ()
    official: bool = True  # False: kvjax's stdlib-text variant of an essay task; not RULER's score

    @property
    def tokens_to_generate(self) -> int:
        return TEMPLATES[self.kind]["tokens_to_generate"]

    @property
    def template(self) -> str:
        """RULER's prepare.py with the "base" model template: the task template + the answer prefix."""
        t = TEMPLATES[self.kind]
        return t["template"] + t["answer_prefix"]

    def arg(self, name: str, default=None):
        return dict(self.args).get(name, default)


def _niah(name, haystack, k, v, nk=1, nv=1, nq=1, official=True):
    return Task(name, "niah", (("type_haystack", haystack), ("type_needle_k", k), ("type_needle_v", v),
                               ("num_needle_k", nk), ("num_needle_v", nv), ("num_needle_q", nq)), official)


# ---- scripts/synthetic.yaml ----
TASKS = {t.name: t for t in (
    _niah("niah_single_1", "noise", "words", "numbers"),
    _niah("niah_multikey_2", "needle", "words", "numbers"),
    _niah("niah_multikey_3", "needle", "uuids", "uuids"),
    Task("vt", "variable_tracking", (("num_chains", 1), ("num_hops", 4))),
    Task("cwe", "common_words_extraction", (("freq_cw", 30), ("freq_ucw", 3), ("num_cw", 10))),
    Task("fwe", "freq_words_extraction", (("alpha", 2.0),)),
    # RULER's essay tasks, on the standard library's English text instead of Paul Graham's essays.
    _niah("niah_single_2_stdlib", "essay", "words", "numbers", official=False),
    _niah("niah_single_3_stdlib", "essay", "words", "uuids", official=False),
    _niah("niah_multikey_1_stdlib", "essay", "words", "numbers", nk=4, official=False),
    _niah("niah_multivalue_stdlib", "essay", "words", "numbers", nv=4, official=False),
    _niah("niah_multiquery_stdlib", "essay", "words", "numbers", nq=4, official=False),
    # read from a local data directory (`generate(data_dir=...)`, `--data-dir`): not generated offline
    Task("qa_1", "qa", (("dataset", "squad"),)),
    Task("qa_2", "qa", (("dataset", "hotpotqa"),)),
)}
NEEDS_DATA = tuple(n for n, t in TASKS.items() if t.kind == "qa")
OFFICIAL = tuple(n for n, t in TASKS.items() if t.official and n not in NEEDS_DATA)  # generated offline


@dataclasses.dataclass(frozen=True)
class Sample:
    """One generated sample, as RULER writes it, plus kvpress's split for the question-agnostic protocol."""

    index: int
    input: str  # everything before the answer prefix (RULER's "input")
    answer_prefix: str
    outputs: tuple[str, ...]  # the references
    length: int  # prompt tokens (input + answer prefix, as the model reads them) + tokens to generate
    context: str  # kvpress: `input` up to the question
    question: str  # kvpress: the question (the answer prefix follows it)

    @property
    def prompt(self) -> str:
        return self.input + self.answer_prefix


# ---- word lists (wonderwords, as RULER) ----


@lru_cache(maxsize=None)
def _wonderwords(name: str) -> tuple[str, ...]:
    from wonderwords.random_word import _get_words_from_text_file  # RULER reads the lists this way too

    return tuple(_get_words_from_text_file(name))


@lru_cache(maxsize=None)
def niah_words() -> tuple[str, ...]:
    """`{adjective}-{noun}`, de-duplicated and sorted (NIAH's word keys)."""
    adjs, nouns = _wonderwords("adjectivelist.txt"), _wonderwords("nounlist.txt")
    return tuple(sorted({f"{a}-{n}" for a in adjs for n in nouns}))


def cwe_words(seed: int) -> list[str]:
    """Nouns + adjectives + verbs, de-duplicated, sorted, shuffled with `random.Random(seed)`."""
    words = sorted(set(_wonderwords("nounlist.txt") + _wonderwords("adjectivelist.txt")
                       + _wonderwords("verblist.txt")))
    random.Random(seed).shuffle(words)
    return words


@lru_cache(maxsize=None)
def essay_words() -> tuple[str, ...]:
    """The essay haystack's words: the held-out standard-library reference text, whitespace-normalised."""
    from kvjax.experiments import corpus

    text = " ".join(t for _, t in corpus.doc_documents("heldout"))
    return tuple(re.sub(r"\s+", " ", text).strip().split(" "))


def split_sentences(text: str) -> list[str]:
    """Sentences ending in . ! or ? followed by whitespace (stand-in for nltk's punkt)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


# ---- one generator per kind; each returns (text = template formatted, references) ----


class _Draws:
    """RULER's random state: module-level `random` and `np.random`, both seeded once per task."""

    def __init__(self, seed: int):
        self.seed = seed
        self.py = random.Random(seed)
        self.np = np.random.RandomState(seed)


def _random_value(kind: str, d: _Draws) -> str:
    if kind == "numbers":
        return str(d.py.randint(10**6, 10**7 - 1))
    if kind == "words":
        return d.py.choice(niah_words())
    if kind == "uuids":
        return str(uuid.UUID(int=d.py.getrandbits(128), version=4))
    raise InvalidInput(f"needle type {kind!r}; expected numbers, words or uuids")


def _singular(template: str) -> str:
    """NIAH's rewrite when one value is asked for."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        template = template.replace(old, new)
    return template


def niah_text(task: Task, num_haystack: int, d: _Draws) -> tuple[str, list[str]]:
    a = dict(task.args)
    nk = max(a["num_needle_k"], a["num_needle_q"])
    tk, tv = a["type_needle_k"], a["type_needle_v"]
    keys, values, needles = [], [], []
    for _ in range(nk):
        keys.append(_random_value(tk, d))
        value = []
        for _ in range(a["num_needle_v"]):
            value.append(_random_value(tv, d))
            needles.append(NEEDLE.format(type_needle_v=tv, key=keys[-1], value=value[-1]))
        values.append(value)
    random.Random(d.seed).shuffle(needles)

    if a["type_haystack"] == "essay":
        words = essay_words()
        reps = -(-num_haystack // len(words))
        sents = split_sentences(" ".join((words * reps)[:num_haystack]))
        cuts = [0] + sorted(int(len(sents) * (depth / 100)) for depth in d.py.sample(DEPTHS, len(needles))) \
            + [len(sents)]
        parts = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(parts)
    else:
        if a["type_haystack"] == "noise":
            sentences = [NOISE] * num_haystack
        else:  # needle: every line a distractor needle with fresh random keys and values
            sentences = [NEEDLE.format(type_needle_v=tv, key=_random_value(tk, d), value=_random_value(tv, d))
                         for _ in range(num_haystack)]
        for index, element in zip(sorted(d.py.sample(range(num_haystack), len(needles)), reverse=True), needles):
            sentences.insert(index, element)
        context = "\n".join(sentences)

    indices = d.py.sample(range(nk), a["num_needle_q"])
    queries = [keys[i] for i in indices]
    answers = [x for i in indices for x in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, type_v = task.template, tv
    if a["num_needle_q"] * a["num_needle_v"] == 1:
        template, type_v = _singular(template), tv[:-1]
    return template.format(type_needle_v=type_v, context=context, query=query), answers


def vt_chains(num_chains: int, num_hops: int, d: _Draws, icl: bool) -> tuple[list[list[str]], list[list[str]]]:
    k = 3 if icl else 5
    num_hops = min(10, num_hops) if icl else num_hops
    names = ["".join(d.py.choices(string.ascii_uppercase, k=k)) for _ in range((num_hops + 1) * num_chains)]
    while len(set(names)) < num_chains * (num_hops + 1):
        names.append("".join(d.py.choices(string.ascii_uppercase, k=k)))
    variables, chains = [], []
    for i in range(0, len(names), num_hops + 1):
        these = names[i:i + num_hops + 1]
        variables.append(these)
        chain = [f"VAR {these[0]} = {12345 if icl else d.np.randint(10000, 99999)}"]
        chain += [f"VAR {these[j + 1]} = VAR {these[j]} " for j in range(num_hops)]
        chains.append(chain)
    return variables, chains


def vt_text(task: Task, num_noises: int, d: _Draws, icl: bool) -> tuple[str, list[str]]:
    num_chains, num_hops = task.arg("num_chains"), task.arg("num_hops")
    variables, chains = vt_chains(num_chains, num_hops, d, icl)
    value = chains[0][0].split("=")[-1].strip()
    sentences = [NOISE] * num_noises
    for chain in chains:
        at = sorted(d.py.sample(range(len(sentences)), len(chain)))
        for p, j in zip(at, range(len(chain))):
            sentences.insert(p + j, chain[j])
    context = "\n".join(sentences).replace(". \n", ".\n")
    return task.template.format(context=context, query=value, num_v=num_hops + 1), variables[0]


def cwe_example(words: list[str], num_words: int, common: int, uncommon: int, num_cw: int, d: _Draws
                ) -> tuple[str, list[str]]:
    if num_words > len(words):
        raise InvalidInput(f"cwe needs {num_words} distinct words at this length; wonderwords has {len(words)} "
                           "(RULER then reads its own english_words.json, which kvjax does not ship): use a "
                           "shorter length for cwe")
    full = d.py.sample(words, num_words)
    common_words, rest = full[:num_cw], full[num_cw:]
    listed = common_words * int(common) + rest * int(uncommon)
    random.Random(d.seed).shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common_words


def cwe_text(task: Task, num_words: int, d: _Draws, words: list[str], max_seq_length: int) -> tuple[str, list[str]]:
    num_cw = task.arg("num_cw")
    if max_seq_length < 4096:  # RULER's short variant
        shots = [cwe_example(words, 20, 3, 1, num_cw, d)]
        context, answer = cwe_example(words, num_words, 6, 1, num_cw, d)
    else:
        shots = [cwe_example(words, 40, 10, 3, num_cw, d)]
        context, answer = cwe_example(words, num_words, task.arg("freq_cw"), task.arg("freq_ucw"), num_cw, d)
    shown = [task.template.format(num_cw=num_cw, context=c, query="") + " "
             + " ".join(f"{i + 1}. {w}" for i, w in enumerate(a)) for c, a in shots]
    return "\n".join(shown) + "\n" + task.template.format(num_cw=num_cw, context=context, query=""), answer


def zeta(alpha: float) -> float:
    """Riemann zeta for alpha > 1 (exact for RULER's alpha = 2: pi^2 / 6)."""
    if alpha == 2.0:
        return math.pi ** 2 / 6
    if alpha <= 1:
        raise InvalidInput(f"fwe alpha={alpha} must be > 1")
    n = 1000  # direct sum + Euler-Maclaurin tail, accurate to double precision for alpha > 1
    head = sum(k ** -alpha for k in range(1, n))
    return head + n ** (1 - alpha) / (alpha - 1) + 0.5 * n ** -alpha + alpha * n ** (-alpha - 1) / 12


def fwe_vocab(vocab_size: int, d: _Draws, wordlen: int = 6) -> list[str]:
    vocab = ["".join(d.py.choices(string.ascii_lowercase, k=wordlen)) for _ in range(vocab_size)]
    while len(set(vocab)) < vocab_size:
        vocab.append("".join(d.py.choices(string.ascii_lowercase, k=wordlen)))
    vocab = sorted(set(vocab))
    random.Random(d.seed).shuffle(vocab)
    vocab[0] = "..."  # the top-ranked word is noise
    return vocab


def fwe_counts(num_words: int, vocab_size: int, alpha: float) -> np.ndarray:
    """How often each rank appears: `int(N k^-alpha / zeta(alpha))`."""
    k = np.arange(1, vocab_size + 1)
    return (num_words * (k ** -alpha) / zeta(alpha)).astype(int)


def fwe_text(task: Task, vocab: list[str], num_words: int, d: _Draws) -> tuple[str, list[str]]:
    counts = fwe_counts(num_words, len(vocab), task.arg("alpha"))
    sampled = [w for w, c in zip(vocab, counts) for _ in range(int(c))]
    random.Random(d.seed).shuffle(sampled)
    return task.template.format(context=" ".join(sampled), query=""), vocab[1:4]


# ---- fitting and sample generation ----


def _binary_search(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """The largest n in [low, high] with fits(n) (RULER's search, which assumes monotonicity)."""
    best = None
    while low <= high:
        mid = (low + high) // 2
        if fits(mid):
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best


def _split(text: str, kind: str) -> tuple[str, str]:
    """(input, answer prefix): RULER cuts at the last occurrence of the prefix's first 10 characters."""
    cut = text.rfind(TEMPLATES[kind]["answer_prefix"][:10])
    return text[:cut], text[cut:]


# kvpress's split of RULER's input into context and question (evaluation/benchmarks/ruler).
QUESTION_PATTERNS = {
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "variable_tracking": re.compile(r"Question: Find all variables that are assigned the value"),
    "common_words_extraction": re.compile(r"Question: What are the 10 most common words in the above list\?"),
    "freq_words_extraction": re.compile(r"Question: Do not provide any explanation\."),
    "qa": re.compile(r"Answer the question based on the given documents\."),
}


def split_question(text: str, kind: str) -> tuple[str, str]:
    """(context, question): the context ends where the last question starts."""
    start = list(QUESTION_PATTERNS[kind].finditer(text))[-1].start()
    return text[:start], text[start:]


def generate(task: Task | str, max_seq_length: int, num_samples: int, count: Callable[[str], int],
             seed: int = DEFAULT_SEED, tokens_to_generate: int | None = None, data_dir=None) -> list[Sample]:
    """`num_samples` samples of `task` whose prompt (as `count` tokenizes it) plus the tokens to
    generate (the task's, unless `tokens_to_generate` overrides them) fit `max_seq_length`, each as
    close to it as one haystack step. QA reads its dataset from `data_dir` (`QA_FILES`)."""
    task = TASKS[task] if isinstance(task, str) else task
    d = _Draws(seed)
    gen = task.tokens_to_generate if tokens_to_generate is None else tokens_to_generate
    if max_seq_length <= gen:
        raise InvalidInput(f"{task.name}: length {max_seq_length} leaves no room for its {gen} generated tokens")

    icl = ""
    if task.kind == "qa":
        qas, docs = read_qa(task, data_dir)
        step = 10  # RULER's `incremental`
        make = lambda n, index=0: qa_text(task, qas, docs, index, n, d)  # noqa: E731
        per = count(make(step)[0]) / step
        high = max(int(max_seq_length / per * 3), step * 2)
    elif task.kind == "niah":
        essay = task.arg("type_haystack") == "essay"
        step = 500 if essay else (25 if max_seq_length >= 4096 else 5)
        make = lambda n: niah_text(task, n, d)  # noqa: E731
        per = count(make(step)[0]) / step
        high = max(int(max_seq_length / per * 3), step * 2)
    elif task.kind == "variable_tracking":
        icl = _vt_example(task, count, d)
        icl_tokens = count(icl)
        step = 10 if max_seq_length >= 4096 else 5
        make = lambda n: vt_text(task, n, d, icl=False)  # noqa: E731
        per = count(make(step)[0]) / step
        high = max(int(max_seq_length / per * 3), step * 2)
    elif task.kind == "common_words_extraction":
        words, step = cwe_words(seed), 10
        make = lambda n: cwe_text(task, n, d, words, max_seq_length)  # noqa: E731
        per = count(make(4096)[0]) / 4096
        high = max(int(max_seq_length // per) * 2, step * 2)
    else:
        return _fwe_samples(task, max_seq_length, num_samples, count, d, gen)

    def length(text: str) -> int:
        return count(text) + gen + (icl_tokens if icl else 0)

    best = _binary_search(lambda n: length(make(n)[0]) <= max_seq_length, step, high)
    num = best if best is not None else step
    samples = []
    if task.kind == "qa" and num_samples > len(qas):
        raise InvalidInput(f"{task.name}: {num_samples} samples asked, its file has {len(qas)} answerable questions")
    for index in range(num_samples):
        used, redraws = num, 0
        while True:
            # QA asks the dataset's questions in order (RULER: QAS[index]); the others draw afresh
            text, answer = make(used, index) if task.kind == "qa" else make(used)
            if icl:
                text = _vt_rename(icl, task.arg("num_hops"), d) + "\n" + text
            total = count(text) + gen
            if total <= max_seq_length:
                break
            if used > step:
                used -= step
                continue
            # At the smallest haystack RULER draws again until a draw fits (QA's documents differ in length),
            # forever if none does; kvjax stops after REDRAWS draws.
            redraws += 1
            if redraws >= REDRAWS:
                raise InvalidInput(f"{task.name} does not fit in {max_seq_length} tokens with this tokenizer: its "
                                   f"smallest haystack gives {total} tokens (prompt + {gen} generated) in "
                                   f"{REDRAWS} draws")
        samples.append(_sample(index, text, answer, total, task.kind))
    return samples


def read_qa(task: Task, data_dir) -> tuple[list[dict], list[str]]:
    """RULER's `read_squad` / `read_hotpotqa`: the questions (SQuAD's answerable ones), each with the indices of
    its gold documents (and, for SQuAD, of its article's other paragraphs), and the distinct documents, sorted."""
    import json
    from pathlib import Path

    name = task.arg("dataset")
    if data_dir is None:
        raise InvalidInput(f"{task.name} reads {name} from a data directory (--data-dir DIR with {QA_FILES[name]}, "
                           "as RULER's scripts/data/synthetic/json/download_qa_dataset.sh writes it)")
    path = Path(data_dir) / QA_FILES[name]
    if not path.is_file():
        raise InvalidInput(f"{task.name}: no {path} ({name}, as RULER's download_qa_dataset.sh writes it)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if name == "squad":
            docs = sorted({p["context"] for art in data["data"] for p in art["paragraphs"]})
            at = {c: i for i, c in enumerate(docs)}
            qas = []
            for art in data["data"]:
                article = [at[p["context"]] for p in art["paragraphs"]]
                for p in art["paragraphs"]:
                    qas += [{"query": q["question"], "outputs": [a["text"] for a in q["answers"]],
                             "context": [at[p["context"]]], "more": [i for i in article if i != at[p["context"]]]}
                            for q in p["qas"] if not q["is_impossible"]]
        else:
            text = lambda title, sents: f"{title}\n{''.join(sents)}"  # noqa: E731
            docs = sorted({text(t, p) for row in data for t, p in row["context"]})
            at = {c: i for i, c in enumerate(docs)}
            qas = [{"query": row["question"], "outputs": [row["answer"]],
                    "context": [at[text(t, p)] for t, p in row["context"]], "more": []} for row in data]
    except (ValueError, KeyError, TypeError) as err:
        raise InvalidInput(f"{path} is not {name} in RULER's format ({type(err).__name__}: {err})") from None
    return qas, docs


def qa_text(task: Task, qas: list[dict], docs: list[str], index: int, num_docs: int, d: _Draws
            ) -> tuple[str, list[str]]:
    """RULER's QA prompt: question `index`'s gold documents, then its article's other paragraphs, then random
    others up to `num_docs` (drawn from the task's random state), shuffled by a fresh `Random(seed)`, numbered."""
    qa = qas[index]
    gold, more = qa["context"], qa["more"]
    if num_docs < len(docs):
        if num_docs - len(gold) > len(more):
            rest = [i for i in range(len(docs)) if i not in gold + more]
            picked = gold + more + d.py.sample(rest, max(0, num_docs - len(gold) - len(more)))
        else:
            picked = gold + d.py.sample(more, num_docs - len(gold))
        chosen = [docs[i] for i in picked]
    else:
        chosen = (docs * -(-num_docs // len(docs)))[:num_docs]
    random.Random(d.seed).shuffle(chosen)
    context = "\n\n".join(DOCUMENT.format(i=i + 1, document=doc) for i, doc in enumerate(chosen))
    return task.template.format(context=context, query=qa["query"]), list(qa["outputs"])


def _sample(index: int, text: str, answer, total: int, kind: str) -> Sample:
    inp, prefix = _split(text, kind)
    context, question = split_question(inp, kind)
    return Sample(index, inp, prefix, tuple(answer), total, context, question)


def _vt_example(task: Task, count, d: _Draws) -> str:
    """VT's one-shot example: generated first, at 500 tokens and nothing to generate, with the answer."""
    step = 5
    per = count(vt_text(task, step, d, icl=True)[0]) / step
    best = _binary_search(lambda n: count(vt_text(task, n, d, icl=True)[0]) <= 500, step, max(int(500 / per * 3),
                                                                                                  step * 2))
    used = best if best is not None else step
    while True:
        text, answer = vt_text(task, used, d, icl=True)
        if count(text) <= 500 or used <= step:
            break
        used -= step
    return text + " " + " ".join(answer) + "\n"


def _vt_rename(example: str, num_hops: int, d: _Draws) -> str:
    """RULER's `randomize_icl`: new names for the example's variables and a new value for 12345."""
    for name in example.strip().split()[-num_hops - 1:]:
        example = example.replace(name, "".join(d.py.choices(string.ascii_uppercase, k=len(name))))
    return example.replace("12345", str(d.np.randint(10000, 99999)))


def _fwe_samples(task: Task, max_seq_length: int, num_samples: int, count, d: _Draws, gen: int) -> list[Sample]:
    limit = max_seq_length - gen  # the prompt's room, which RULER also sizes the vocabulary from
    vocab_size = limit // 50
    if vocab_size < 4:
        raise InvalidInput(f"fwe needs length >= {200 + gen} (a vocabulary of (length - {gen} generated) // 50 >= 4 "
                           f"words); got {max_seq_length}")
    step = max(limit // 32, 1)

    def fit(num_words: int | None) -> tuple[str, list[str], int]:
        vocab = fwe_vocab(vocab_size, d)
        if num_words is not None:
            text, answer = fwe_text(task, vocab, num_words, d)
            while count(text) > limit:
                num_words -= step
                if num_words <= 0:
                    raise InvalidInput(f"fwe does not fit in {max_seq_length} tokens with this tokenizer")
                text, answer = fwe_text(task, vocab, num_words, d)
            return text, answer, num_words
        num_words = limit // 6
        text, answer = fwe_text(task, vocab, num_words, d)
        while count(text) < limit:
            num_words += step
            text, answer = fwe_text(task, vocab, num_words, d)
        num_words -= step
        text, answer = fwe_text(task, vocab, num_words, d)
        return text, answer, num_words

    _, _, num_words = fit(None)
    samples = []
    for index in range(num_samples):
        text, answer, _ = fit(num_words)
        samples.append(_sample(index, text, answer, count(text) + gen, task.kind))
    return samples


def token_counter(tokenizer) -> Callable[[str], int]:
    """Tokens the model reads for `text`: the tokenizer's ids, special tokens (BOS) included."""
    # verbose=False: RULER's fitting tokenizes texts longer than the model on purpose; no warning.
    return lambda text: len(tokenizer(text, verbose=False)["input_ids"])


__all__ = ["DEFAULT_SEED", "METRICS", "NEEDS_DATA", "OFFICIAL", "QA_FILES", "Sample", "TASKS", "TEMPLATES", "Task",
           "generate", "qa_text", "read_qa", "split_question",
           "token_counter"]
