"""RULER (Hsieh et al. 2024): its synthetic tasks generated offline (`tasks`), its scoring (`scoring`),
and `python -m kvjax.experiments.ruler`, which runs them under kvjax cache policies."""
