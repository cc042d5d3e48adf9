"""LongBench v1 / LongBench-E harness and kvjax's offline LongBench-format suite (`python -m kvjax.experiments.longbench`)."""
