"""CPU and memory of processes and of the machine, from /proc: what the benchmarks report beside their numbers."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pids: list[int]) -> float:
    """user + system CPU seconds of these processes (all their threads)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def machine_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (all cores), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def vm_hwm(pid: int) -> int:
    """Peak resident set size in bytes (VmHWM), 0 if the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])
