"""Small SQuAD 2.0 / HotpotQA files in RULER's formats, made up here (the real ones need a download), for the
QA tasks' tests; `tests/data/ruler_qa/*.jsonl` is what RULER's own `qa.py` wrote from them (see that folder)."""

import json
import random

WORDS = ("river stone harbor lantern meadow copper violet engine orchard falcon signal winter quarry pepper "
         "tunnel cedar marble velvet ember glacier saddle compass thistle beacon").split()


def _sentence(r: random.Random, n: int) -> str:
    return " ".join(r.choice(WORDS) for _ in range(n)).capitalize() + "."


def squad(seed: int = 0, articles: int = 6, paragraphs: int = 3) -> dict:
    r = random.Random(seed)
    data = []
    for a in range(articles):
        paras = []
        for p in range(paragraphs):
            context = " ".join(_sentence(r, r.randint(6, 12)) for _ in range(r.randint(2, 4)))
            qas = [{"question": f"What did item {a}-{p}-{q} hold?", "id": f"{a}{p}{q}", "is_impossible": q == 1,
                    "answers": [] if q == 1 else [{"text": context.split()[q], "answer_start": 0},
                                                   {"text": context.split()[q + 1], "answer_start": 0}]}
                   for q in range(3)]
            paras.append({"context": context, "qas": qas})
        if a == 2:  # a paragraph shared by two articles: documents are deduplicated
            paras.append({"context": data[0]["paragraphs"][0]["context"], "qas": []})
        data.append({"title": f"Article {a}", "paragraphs": paras})
    return {"version": "v2.0", "data": data}


def hotpotqa(seed: int = 1, rows: int = 8) -> list:
    r = random.Random(seed)
    titles = [f"Title {i}" for i in range(14)]
    out = []
    for i in range(rows):
        ctx = [[t, [_sentence(r, r.randint(5, 9)) + " " for _ in range(2)]] for t in r.sample(titles, 4)]
        out.append({"_id": str(i), "question": f"Which title links clue {i}?", "answer": ctx[0][0], "context": ctx,
                    "type": "bridge", "level": "easy", "supporting_facts": []})
    return out


def write(folder) -> None:
    from pathlib import Path

    Path(folder, "squad.json").write_text(json.dumps(squad()))
    Path(folder, "hotpotqa.json").write_text(json.dumps(hotpotqa()))
