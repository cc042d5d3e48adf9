"""Benchmark tables that can be trusted (issue #64, item 5): every time the median of repeats with its range, the
load average before and after the run in the JSON and under the table, and a CPU table refused on a busy machine
(or, with --allow-load, marked MEASURED UNDER LOAD). The load is faked: numbers are never asserted."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import quant, timing
from kvjax import cli
from kvjax import machine as machine_module


def test_a_spread_is_its_median_and_range_and_a_rate_inverts_it():
    s = timing.Spread((0.5, 0.2, 0.4))
    assert (s.median, s.min, s.max) == (0.4, 0.2, 0.5)
    assert s.fields("t") == {"t": 0.4, "t_min": 0.2, "t_max": 0.5}
    r = s.rate(10)  # tokens/s: the slowest run is the lowest rate
    assert (r.median, r.min, r.max) == (25.0, 20.0, 50.0)
    assert timing.cell(s.fields("t"), "t", ".2f") == "0.40 (0.20–0.50)"
    assert timing.cell({"t": 0.4}, "t", ".2f") == "0.40"  # a row without a range (one repeat, an older table)
    with pytest.raises(ValueError):
        timing.Spread(())


def test_repeat_times_after_a_warm_up():
    calls = []
    s = timing.repeat(lambda: calls.append(1), 3)
    assert len(calls) == 4 and len(s.samples) == 3


def _loads(monkeypatch, *loads):
    """os.getloadavg returns each of `loads` in turn (then the last), on a 2-core machine."""
    seq = list(loads)
    monkeypatch.setattr(os, "getloadavg", lambda: seq.pop(0) if len(seq) > 1 else seq[0])
    monkeypatch.setattr(timing, "cores", lambda: 2)
    monkeypatch.setattr(timing, "machine", lambda cpuinfo=None: "Test CPU (family 6, model 1), 2 cores")


ARGV = ["--lengths", "64", "--steps", "2", "--repeats", "2", "--widths", "16,8", "--no-variants"]


def test_a_cpu_table_is_refused_on_a_busy_machine_in_one_line(tmp_path, monkeypatch, capsys):
    _loads(monkeypatch, (1.73, 1.2, 0.9))
    assert cli.run(quant.main, [*ARGV, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: the 1-minute load average is 1.73 on 2 cores, above --max-load 1: a CPU table measured "
                   "now would time other work too; wait for a quiet machine, or pass --allow-load to write it marked "
                   "MEASURED UNDER LOAD"]
    assert not list(tmp_path.iterdir())  # refused before anything was measured or written
    # a higher limit lets it run
    assert not cli.run(quant.main, [*ARGV, "--out", str(tmp_path), "--max-load", "2"])  # exit status 0
    assert json.loads((tmp_path / "quant_cpu.json").read_text())["load"]["under_load"] is False


def test_allow_load_writes_the_table_marked_and_records_the_load_and_the_range(tmp_path, monkeypatch):
    _loads(monkeypatch, (1.73, 1.2, 0.9), (2.5, 1.5, 1.0))
    quant.main([*ARGV, "--out", str(tmp_path), "--allow-load"])
    record = json.loads((tmp_path / "quant_cpu.json").read_text())
    assert record["load"] == {"before": [1.73, 1.2, 0.9], "after": [2.5, 1.5, 1.0], "cores": 2, "max_load": 1.0,
                              "cpu": True, "machine": "Test CPU (family 6, model 1), 2 cores", "under_load": True,
                              "why": "1-minute load 1.73 before the run > 1"}
    assert record["warning"] == "MEASURED UNDER LOAD: 1-minute load 1.73 before the run > 1"
    for r in record["rows"]:
        assert r["tok_s_min"] <= r["tok_s"] <= r["tok_s_max"]
    md = (tmp_path / "quant_cpu.md").read_text().splitlines()
    assert md[0].startswith("# MEASURED UNDER LOAD (1-minute load 1.73 before the run > 1): Quantized cache")
    assert md[-1] == ("Load average (1 / 5 / 15 min) before the run 1.73 / 1.20 / 0.90, after 2.50 / 1.50 / 1.00, on "
                      "Test CPU (family 6, model 1), 2 cores; a CPU table is measured only at a 1-minute load of at most "
                      "1 before the run. Times: the median of 2 timed runs (min–max).")
    row = next(line for line in md if line.startswith("| 64 | 16 |"))
    assert "–" in row.split("|")[3]  # the decode tok/s cell: median (min–max)


def test_a_table_whose_load_rose_past_the_run_s_own_is_marked(tmp_path, monkeypatch):
    """Quiet before, but after the run the 1-minute load exceeds the cores the run itself used plus the limit:
    something started beside it."""
    _loads(monkeypatch, (0.1, 0.2, 0.3), (3.4, 1.0, 0.5))
    quant.main([*ARGV, "--out", str(tmp_path)])
    record = json.loads((tmp_path / "quant_cpu.json").read_text())
    assert record["load"]["under_load"] and record["load"]["why"] == "1-minute load 3.40 after the run > 2 cores + 1"
    assert (tmp_path / "quant_cpu.md").read_text().startswith("# MEASURED UNDER LOAD (1-minute load 3.40 after")


def test_a_gpu_run_records_the_load_but_is_never_refused(monkeypatch):
    _loads(monkeypatch, (9.0, 9.0, 9.0))
    guard = timing.LoadGuard(type("Args", (), {"max_load": None, "allow_load": False})(), cpu=False)
    guard.check()
    assert guard.record()["under_load"] is False
    assert guard.mark(["# t", "| a |"])[-1].startswith("Load average (1 / 5 / 15 min) before the run 9.00")


# /proc/cpuinfo of two cores of a VM, abridged (a real one repeats ~25 fields per processor)
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9B14
flags\t\t: fpu vme avx512f

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9B14
"""

# an Arm Neoverse V2 core's block (Linux on arm64), abridged
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm sve sve2
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x0
CPU part\t: 0xd4f
CPU revision\t: 1

processor\t: 1
BogoMIPS\t: 2000.00
"""


def test_a_timing_names_the_machine_it_ran_on(monkeypatch):
    """Compile seconds and timings compare only on one machine (kvjax's tables have come from VMs whose matmuls
    differ 2x), so every table names it: the model name with its family and model numbers, and the cores."""
    monkeypatch.setattr("kvjax.machine.cores", lambda: 2)
    assert timing.machine(CPUINFO) == "AMD EPYC 9B14 (family 25, model 17), 2 cores"
    # Arm's cpuinfo has no model name: the architecture's name with the implementer and part codes
    monkeypatch.setattr(machine_module.platform, "processor", lambda: "")
    monkeypatch.setattr(machine_module.platform, "machine", lambda: "aarch64")
    assert timing.machine(ARM_CPUINFO) == "aarch64 (implementer 0x41, part 0xd4f), 2 cores"
    assert timing.machine("") == "aarch64, 2 cores"  # no cpuinfo (not Linux): Python's name for the processor

