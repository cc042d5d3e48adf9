"""The machine a timing ran on, named in one line (`machine()`), and the cores this process may use: every timing
kvjax records (the benchmarks' tables, the decoding suite's tok/s) names it, as timings compare only on one machine."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


CPUINFO = Path("/proc/cpuinfo")


def machine(cpuinfo: str | None = None) -> str:
    """The CPU a timing ran on, in one line: its model name with its x86 family and model numbers (a virtual
    machine's name can be as vague as "Intel(R) Xeon(R) Processor"), or on Arm, whose cpuinfo has no model name,
    the architecture with the implementer and part codes; and the cores this process may use, e.g.
    `AMD EPYC 9B14 (family 25, model 17), 2 cores`, `aarch64 (implementer 0x41, part 0xd4f), 4 cores`. Timings
    (compile seconds included) compare only on one machine: kvjax's CPU tables have come from VMs whose matmuls
    differ 2x. `cpuinfo`: /proc/cpuinfo's text (read where
    None); without it, Python's name for the processor."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:  # not Linux
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():  # the first processor's block is enough: a VM's cores are alike
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    elif "CPU implementer" in fields and "CPU part" in fields:
        name += f" (implementer {fields['CPU implementer']}, part {fields['CPU part']})"
    return f"{name}, {cores()} cores"


__all__ = ["CPUINFO", "cores", "machine"]
