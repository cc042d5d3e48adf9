"""Synthetic long-range tasks: their prompt texts (shared by training, the LongBench-format suite
and the passkey suite) and a token-level row sampler for `kvjax.experiments.train_tiny`.

The passkey prompt is the LongLoRA / landmark one. Besides natural text, rows hold passkey, key-value,
fact-QA, title-retrieval, counting and copy tasks, and repeated random tokens (pure induction). Rows
for training are built from token-id segments, so a row has an exact length without re-tokenising;
each segment carries a loss weight, and answer tokens are up-weighted so the long-range signal is not
drowned by filler.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from kvjax.errors import InvalidInput

SPECIAL_IDS = range(4)  # <unk> <s> </s> <pad>: never drawn as random tokens

PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                 "I will quiz you about the important information there.")
PASSKEY_GARBAGE = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_ASK = " What is the pass key?"
PASSKEY_ANSWER = "The pass key is"  # the answer's start: after the question raw, after the assistant header in a chat
PASSKEY_QUESTION = PASSKEY_ASK + " " + PASSKEY_ANSWER


def passkey_needle(key: int | str) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key."


KV_INTRO = "Extract the value corresponding to the specified key in the table below.\n"
KV_LINES = (4, 200)  # [lo, hi) table lines of a question-dense key-value row (RowSampler(kv_queries=N))
FACT_COUNT = (3, 17)  # [lo, hi) facts hidden in a question-dense fact row (RowSampler(fact_queries=N))
TITLE_COUNT = (4, 16)  # [lo, hi) titled paragraphs in a title-retrieval row
TITLE_QUERIES = 8  # questions on them, each "which paragraph is titled X?"
# sound lines hidden in text, counted by the marker-count task: (the line, "how many times does ___?")
MARKERS = (("The bell rings.", "the bell ring"), ("A dog barks.", "a dog bark"), ("The door opens.", "the door open"),
           ("The clock strikes.", "the clock strike"), ("A horn sounds.", "a horn sound"),
           ("The kettle whistles.", "the kettle whistle"))
MARKER_TIMES = (1, 6)  # [lo, hi) times one sound occurs
MARKER_KINDS = (2, 5)  # [lo, hi) sounds in one marker-count training row, each asked once


def kv_line(key: str, value: str) -> str:
    return f"{key}: {value}\n"


def kv_question(key: str) -> str:
    return f"The value of key {key} is"


SYLLABLES = ("ka", "lo", "mi", "ra", "ven", "dor", "sa", "tu", "bel", "qui", "zan", "mo", "ri", "el", "thar", "un",
             "po", "les", "gra", "fin", "do", "wen", "ix", "cor")
ATTRIBUTES = ("capital", "founder", "river", "mountain", "festival", "guardian")


def made_up_name(rng: np.random.Generator) -> str:
    n = int(rng.integers(2, 4))
    return "".join(SYLLABLES[i] for i in rng.integers(0, len(SYLLABLES), n)).capitalize()


def distinct_names(rng: np.random.Generator, n: int) -> list[str]:
    """n different made-up names (a repeated title would make its question ambiguous)."""
    names: list[str] = []
    while len(names) < n:
        if (name := made_up_name(rng)) not in names:
            names.append(name)
    return names


def fact_sentence(attribute: str, subject: str, value: str) -> str:
    return f" The {attribute} of {subject} is {value}."


def question_line(question: str) -> str:
    return f"\nQuestion: {question}\nAnswer:"


def fact_question(attribute: str, subject: str) -> str:
    return question_line(f"What is the {attribute} of {subject}?")


def paragraph_head(k: int, title: str) -> str:
    """What opens the k-th (from 1) titled paragraph: its title, then its number right after it, as a value
    follows its key (a number ten tokens on, after "Paragraph", was not learned in 600 steps)."""
    return f"{title} ({k}): "


def title_question(title: str) -> str:
    return f"Which paragraph is titled {title}?"


def marker_question(kind: int) -> str:
    return f"How many times does {MARKERS[kind][1]}?"


@dataclasses.dataclass(frozen=True)
class Mixture:
    """Shares of the row kinds in a training batch (normalised)."""

    text: float = 0.30
    passkey: float = 0.20
    kv: float = 0.15
    facts: float = 0.10
    copy: float = 0.10
    induction: float = 0.15
    suite: float = 0.0  # whole evaluation prompts with their answers (`RowSampler(prompts=...)`)
    titles: float = 0.0  # TITLE_QUERIES questions on titled paragraphs
    counts: float = 0.0  # sounds hidden in text, each counted

    def blend(self, other: "Mixture", t: float) -> "Mixture":
        """(1 - t) * self + t * other, share by share."""
        return Mixture(**{f.name: (1 - t) * getattr(self, f.name) + t * getattr(other, f.name)
                          for f in dataclasses.fields(self)})

    def probabilities(self) -> tuple[tuple[str, ...], np.ndarray]:
        names = tuple(f.name for f in dataclasses.fields(self))
        p = np.array([getattr(self, n) for n in names], np.float64)
        if (p < 0).any() or p.sum() <= 0:
            raise InvalidInput(f"mixture shares must be >= 0 and not all 0: {self}")
        return names, p / p.sum()


# Induction first. What it took to teach the default model to retrieve (issue #3, one seed each):
# - on the main mixture alone (15 % induction rows over the full vocabulary, periods 16-64) no
#   induction heads formed in 1000 steps (passkey 0 %, repeats of random tokens not copied);
# - nor when 512-token training rows opened on 60-85 % induction rows (WARM_MIXTURE), by step 500-600;
# - micro runs on whole rows of short-period (4-16) repeats over a 64-symbol alphabet, 4096 tokens a
#   step, lr 3e-3, formed them after ~350-450 steps (loss 2.5 -> 0.1) with 2 layers, MHA, 128-token
#   rows and a 128- or 512-token vocabulary -- but not by step 450-1000 with a 2048 vocabulary,
#   512-token rows, GQA (4/2: 1.27 at step 1000; 8/4: 1.89 at 550) or 4 layers.
# So `kvjax.experiments.train_tiny` opens on a separate stage of short rows of pure repeats (INDUCTION_ONLY),
# then anneals from WARM_MIXTURE to the main mixture in full-length rows (Curriculum).
WARM_MIXTURE = Mixture(text=0.05, passkey=0.10, kv=0.0, facts=0.0, copy=0.0, induction=0.85)
INDUCTION_ONLY = Mixture(text=0.0, passkey=0.0, kv=0.0, facts=0.0, copy=0.0, induction=1.0)


@dataclasses.dataclass(frozen=True)
class Curriculum:
    """What the rows look like at training progress p in [0, 1] (1 = the main regime, kept after).

    Until `hold` the mixture is `warm` and induction rows draw periods `warm_period` from an
    alphabet of `warm_alphabet` ids; from `hold` to 1 all of that moves to the main values
    (mixture linearly, alphabet geometrically)."""

    warm: Mixture = WARM_MIXTURE
    main: Mixture = Mixture()
    hold: float = 0.2
    warm_alphabet: int = 64
    warm_period: tuple[int, int] = (4, 16)
    main_period: tuple[int, int] = (16, 64)

    def at(self, p: float, vocab: int) -> tuple[Mixture, int, tuple[int, int]]:
        """(mixture, induction alphabet size, induction period range [lo, hi]) at progress p."""
        t = min(1.0, max(0.0, (p - self.hold) / (1.0 - self.hold))) if self.hold < 1 else float(p >= 1)
        alphabet = int(round(self.warm_alphabet * (vocab / self.warm_alphabet) ** t))
        period = tuple(int(round(a + (b - a) * t)) for a, b in zip(self.warm_period, self.main_period))
        return self.warm.blend(self.main, t), min(alphabet, vocab), period


class RowSampler:
    """Training rows of exactly `seq_len` tokens: BOS, then natural text, then one task of `span` tokens.

    `code` and `docs` are token streams of natural text; `answer_weight` is the loss weight of
    the tokens a task asks for (everything else weighs 1).
    """

    def __init__(self, tokenizer, code: np.ndarray, docs: np.ndarray, seq_len: int, *,
                 mixture: Mixture = Mixture(), answer_weight: float = 4.0, docs_share: float = 0.3,
                 prompts: list[tuple[list[int], list[int]]] = (), kv_queries: int = 0, fact_queries: int = 0):
        self.tok, self.code, self.docs, self.seq_len = tokenizer, code, docs, seq_len
        # 0: a key-value row is a table filling its span and 1-3 questions; N > 0: a table of KV_LINES lines
        # (as many as the span holds) and N questions on it, so most of the row's loss is on lookups
        self.kv_queries = kv_queries
        # 0: a fact row hides 1-3 facts in text and asks one; N > 0: FACT_COUNT distinct facts and N questions
        self.fact_queries = fact_queries
        # (prompt ids, answer ids) in the evaluation suites' own templates, shortest first
        self.prompts = sorted(prompts, key=lambda pa: len(pa[0]) + len(pa[1]))
        self.prompt_sizes = np.array([len(p) + len(a) for p, a in self.prompts], np.int64)
        self.kinds, self.p = mixture.probabilities()
        self.answer_weight, self.docs_share = answer_weight, docs_share
        self.bos = tokenizer.bos_token_id
        self.vocab = len(tokenizer)
        enc = self.encode
        self.garbage = enc(PASSKEY_GARBAGE)
        self.fixed = {"intro": enc(PASSKEY_INTRO), "question": enc(PASSKEY_QUESTION), "kv_intro": enc(KV_INTRO)}
        # the shortest span every task fits in (the passkey prompt is the longest fixed text), with some
        # room for filler; it grows with smaller vocabularies
        passkey = sum(map(len, (self.fixed["intro"], enc(passkey_needle(12345)), self.fixed["question"],
                                enc(" 12345."))))
        self.min_span = max(128, passkey + 32)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _text(self, rng, n: int, stream: np.ndarray | None = None) -> list[int]:
        if n <= 0:
            return []
        if stream is None:
            stream = self.docs if rng.random() < self.docs_share else self.code
        start = int(rng.integers(0, len(stream) - n))
        return stream[start : start + n].tolist()

    def _filler(self, rng, n: int) -> list[int]:
        if rng.random() < 0.5:  # the landmark garbage, as in the passkey evaluation
            reps = n // len(self.garbage) + 1
            return (self.garbage * reps)[:n]
        return self._text(rng, n, self.docs)

    def row(self, rng: np.random.Generator, span: int | None = None,
            curriculum: tuple[Mixture, int, tuple[int, int]] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One row: (tokens [seq_len] int32, loss weights [seq_len] float32).

        `curriculum` is `Curriculum.at(...)`: the mixture and induction difficulty to draw from
        (default: the sampler's mixture, the full vocabulary, periods 16-64)."""
        span = self.seq_len - 1 if span is None else min(span, self.seq_len - 1)
        if curriculum is None:
            kinds, p, induction = self.kinds, self.p, {}
        else:
            mixture, alphabet, period = curriculum
            (kinds, p), induction = mixture.probabilities(), {"alphabet": alphabet, "period": period}
        kind = kinds[int(rng.choice(len(kinds), p=p))]
        if kind == "text":
            segments = [(self._text(rng, span), 1.0)]
        elif kind != "induction":
            segments = getattr(self, f"_{kind}")(rng, span)
        else:  # repeats have no length curriculum (their difficulty is alphabet and period): whole rows
            segments = self._induction(rng, self.seq_len - 1, **induction)
        used = sum(len(s) for s, _ in segments)
        fill = (self._text(rng, self.seq_len - 1 - used), 1.0)
        # a suite prompt opens the row, as it opens the model's input when evaluated, and text follows it;
        # the other tasks close the row, after their filler
        segments = [([self.bos], 1.0)] + (segments + [fill] if kind == "suite" else [fill] + segments)
        ids = np.concatenate([np.asarray(s, np.int32) for s, _ in segments])
        w = np.concatenate([np.full(len(s), wt, np.float32) for s, wt in segments])
        if len(ids) != self.seq_len:
            raise AssertionError(f"row of {len(ids)} tokens, expected {self.seq_len}")
        return ids, w

    def _suite(self, rng, span):
        fits = int(np.searchsorted(self.prompt_sizes, span, side="right"))
        if fits == 0:  # spans shorter than every suite prompt: the passkey task, whose fixed text is shortest
            return self._passkey(rng, span)
        prompt, answer = self.prompts[int(rng.integers(fits))]
        return [(prompt, 1.0), (answer, self.answer_weight)]

    def _passkey(self, rng, span):
        key = str(int(rng.integers(10000, 100000)))
        # the answer ends as in the needle: a model that never saw what follows the key keeps copying digits
        needle, answer = self.encode(passkey_needle(key)), self.encode(f" {key}.")
        head, q = self.fixed["intro"], self.fixed["question"]
        room = span - len(head) - len(needle) - len(q) - len(answer)
        if room < 0:
            raise InvalidInput(f"a passkey task needs {span - room} tokens with this tokenizer; span={span} is too short")
        filler = self._filler(rng, room)
        cut = int(rng.integers(0, room + 1))
        return [(head, 1.0), (filler[:cut], 1.0), (needle, 1.0), (filler[cut:], 1.0), (q, 1.0),
                (answer, self.answer_weight)]

    def _kv(self, rng, span):
        queries = int(rng.integers(1, 4)) if self.kv_queries == 0 else self.kv_queries
        lines = np.inf if self.kv_queries == 0 else int(rng.integers(*KV_LINES))
        segments, table = [(self.fixed["kv_intro"], 1.0)], []
        used, tail_room = len(self.fixed["kv_intro"]), 24 * queries
        while len(table) < lines:
            k, v = str(int(rng.integers(1000, 10000))), str(int(rng.integers(10000, 100000)))
            line = self.encode(kv_line(k, v))
            if used + len(line) > span - tail_room:
                break
            segments.append((line, 1.0))
            table.append((k, v))
            used += len(line)
        if not table:
            raise InvalidInput(f"a key-value row with {queries} questions needs more than span={span} tokens")
        asked = (rng.choice(len(table), size=min(queries, len(table)), replace=False) if self.kv_queries == 0
                 else rng.choice(len(table), size=queries))
        for i in asked:
            k, v = table[int(i)]
            q, a = self.encode(kv_question(k)), self.encode(f" {v}.\n")
            segments += [(q, 1.0), (a, self.answer_weight)]
        return segments

    def _facts(self, rng, span):
        dense = self.fact_queries > 0
        n = int(rng.integers(*FACT_COUNT)) if dense else int(rng.integers(1, 4))
        facts, asked_about = [], set()
        while len(facts) < n:
            attr, subj = ATTRIBUTES[int(rng.integers(len(ATTRIBUTES)))], made_up_name(rng)
            fact = (attr, subj, made_up_name(rng))
            # two facts with one (attribute, subject) would make a question ambiguous; the 1-3 fact rows
            # keep their draws (and the committed model's rows) as they were
            if dense and (attr, subj) in asked_about:
                continue
            asked_about.add((attr, subj))
            facts.append(fact)
        asked = rng.integers(n, size=self.fact_queries) if dense else [int(rng.integers(n))]
        qa = []
        for i in asked:
            attr, subj, value = facts[int(i)]
            qa += [(self.encode(fact_question(attr, subj)), 1.0), (self.encode(f" {value}."), self.answer_weight)]
        sentences = [self.encode(fact_sentence(*f)) for f in facts]
        return self._hidden(rng, span, sentences, qa, f"a fact row of {n} facts and {len(asked)} questions")

    def _hidden(self, rng, span, sentences: list[list[int]], qa: list, what: str) -> list:
        """`sentences` at random places in docs text, then the questions and answers `qa`: `span` tokens."""
        room = span - sum(len(s) for s, _ in qa) - sum(map(len, sentences))
        if room < 0:
            raise InvalidInput(f"{what} needs {span - room} tokens; span={span} is too short")
        filler = self._text(rng, room, self.docs)
        cuts = sorted(int(c) for c in rng.integers(0, room + 1, len(sentences)))
        segments, prev = [], 0
        for c, s in zip(cuts, sentences):
            segments += [(filler[prev:c], 1.0), (s, 1.0)]
            prev = c
        return segments + [(filler[prev:], 1.0)] + qa

    def _titles(self, rng, span):
        """TITLE_COUNT paragraphs of docs text, each opened by `paragraph_head`, and TITLE_QUERIES questions
        "which paragraph is titled X?" (the suite's title retrieval, question-dense)."""
        n = int(rng.integers(*TITLE_COUNT))
        titles = distinct_names(rng, n)
        qa = []
        for i in rng.integers(n, size=TITLE_QUERIES):
            qa += [(self.encode(question_line(title_question(titles[int(i)]))), 1.0),
                   (self.encode(f" {int(i) + 1}."), self.answer_weight)]
        # each head after a blank line, as in the suite's prompt (whose template has one before the context)
        heads = [self.encode("\n\n" + paragraph_head(j + 1, t)) for j, t in enumerate(titles)]
        room = span - sum(len(s) for s, _ in qa) - sum(map(len, heads))
        if room < n:
            raise InvalidInput(f"a title row of {n} paragraphs and {TITLE_QUERIES} questions needs "
                               f"{span - room + n} tokens; span={span} is too short")
        segments = []
        for h in heads:
            segments += [(h, 1.0), (self._text(rng, room // n, self.docs), 1.0)]
        return segments + qa

    def _counts(self, rng, span):
        """MARKER_KINDS sounds, each MARKER_TIMES times at random places in docs text, then each one's count
        asked (the suite's marker count, with more than one sound so that a count is of the one named)."""
        kinds = rng.choice(len(MARKERS), size=int(rng.integers(*MARKER_KINDS)), replace=False)
        times = rng.integers(*MARKER_TIMES, size=len(kinds))
        lines = [int(k) for k, t in zip(kinds, times) for _ in range(int(t))]
        sentences = [self.encode(" " + MARKERS[lines[int(j)]][0]) for j in rng.permutation(len(lines))]
        qa = []
        for j in rng.permutation(len(kinds)):
            qa += [(self.encode(question_line(marker_question(int(kinds[j])))), 1.0),
                   (self.encode(f" {int(times[j])}."), self.answer_weight)]
        return self._hidden(rng, span, sentences, qa, f"a count row of {len(lines)} sounds")

    def _induction(self, rng, span, alphabet: int | None = None, period: tuple[int, int] = (16, 64)):
        """Random token ids repeated (RazorAttention's probe): only copying predicts the repeats, which
        makes induction heads form early; the first occurrence is unpredictable and weighs 0.

        Ids come from the first `alphabet` non-special ids (default all), periods from [lo, hi]."""
        k = int(rng.integers(period[0], period[1] + 1))
        hi = self.vocab if alphabet is None else min(self.vocab, len(SPECIAL_IDS) + alphabet)
        x = rng.integers(len(SPECIAL_IDS), hi, k).tolist()
        reps = span // k
        return [(x, 0.0)] + [(x, 1.0)] * (reps - 1) + [(x[: span - reps * k], 1.0)]

    def _copy(self, rng, span):
        n = int(rng.integers(16, max(17, (span - 8) // 2)))
        marker = self.encode("\n\n")
        x = self._text(rng, n)
        lead = self._text(rng, span - 2 * n - len(marker))
        return [(lead, 1.0), (x, 1.0), (marker, 1.0), (x, 1.0)]


# kvjax-small's training mixtures (kvjax.experiments.train_small), and --extend-mixture's text form
MIXTURE = Mixture(text=0.20, passkey=0.10, kv=0.10, facts=0.05, copy=0.05, induction=0.10, suite=0.40)
# the third stage: the formats the model failed at full length when it was added were the suites' (passage
# retrieval as it was then, QA, key-value, RULER's needles), so half the rows are suite prompts
EXTEND_MIXTURE = Mixture(text=0.10, passkey=0.10, kv=0.10, facts=0.05, copy=0.05, induction=0.10, suite=0.50)


def mixture_text(m: Mixture) -> str:
    return ",".join(f"{f.name}={getattr(m, f.name):g}" for f in dataclasses.fields(m) if getattr(m, f.name))


def mixture(text: str) -> Mixture:
    """`--extend-mixture`'s value (KIND=SHARE pairs over Mixture's kinds; the record keeps the text)."""
    kinds = {f.name for f in dataclasses.fields(Mixture)}
    shares = dict.fromkeys(kinds, 0.0)
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name.strip() not in kinds:
            raise argparse.ArgumentTypeError(f"{part!r}: the kinds are {', '.join(sorted(kinds))}")
        try:
            shares[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: the share after '=' must be a number") from None
    m = Mixture(**shares)
    try:
        m.probabilities()
    except InvalidInput as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return m
