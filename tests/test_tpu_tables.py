"""The TPU compile tables (`benchmarks.tpu_tables`) from hand-made records: which machine compiled each row."""

from __future__ import annotations

from benchmarks.tpu_tables import write_tables


def _row(shape, seconds, chip="v6e", host=None):
    r = {"kernel": "decode", "shape": shape, "ok": True, "compile_s": seconds, "argument_bytes": 1 << 20,
         "temp_bytes": 0, "peak_bytes": 1 << 20, "chip": chip, "spec": ["decode", shape], "load": 0.5}
    return r | ({"host": host} if host else {})


EPYC, XEON = "AMD EPYC 9B14 (family 25, model 17), 2 cores", "Intel Xeon (family 6, model 207), 2 cores"


def _hosts(md: list[str]) -> dict[str, str]:
    """shape -> the host cell of the kernel table's rows"""
    return {line.split(" | ")[1]: line.rstrip(" |").rsplit(" | ", 1)[1] for line in md if line.startswith("| decode")}


def test_tpu_tables_label_each_compiling_machine_and_the_rows_that_named_none(tmp_path):
    """Rows from two machines and one from before rows named theirs: a host column, and a legend saying which
    machine each label is, so compile seconds are compared only within one. A machine keeps its label in both chips'
    tables, numbered in the order the records first name it."""
    records = [_row("old", 3.6), _row("v5e-only", 5.0, chip="v5e", host=XEON), _row("b1", 6.3, host=EPYC),
               _row("b8", 7.1, host=XEON), _row("b2", 6.4, host=EPYC)]
    md = write_tables(records, "v6e", tmp_path).splitlines()
    assert (f"host (the same programs compiled in 0.5–0.6 of the seconds on one machine as on another, "
            f"`tpu_compile_same_machine.md`): 2: {EPYC}; 1: {XEON}; ?: not recorded (compiled before rows named "
            f"their machine).") in md[2]
    assert _hosts(md) == {"old": "?", "b1": "2", "b8": "1", "b2": "2"}
    # v5e's table: the same number for the same machine, and no legend entry for a machine without a row there
    md = write_tables(records, "v5e", tmp_path).splitlines()
    assert _hosts(md) == {"v5e-only": "1"} and f"): 1: {XEON}. `load`" in md[2]
