"""Device gauges, all optional and failing soft: host CPU and memory from /proc, GPU memory, utilisation and
temperature through NVML where present (names from the OpenTelemetry hardware and system conventions)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

log = logging.getLogger("spillway.agent.telemetry")


def _safe(read: Callable[[], Iterable[Observation]]) -> Callable[[CallbackOptions], Iterable[Observation]]:
    """A probe that fails yields nothing this time; serving never notices."""

    def callback(_options: CallbackOptions) -> Iterable[Observation]:
        try:
            return list(read())
        except Exception:
            log.debug("probe %s failed", getattr(read, "__name__", read), exc_info=True)
            return []

    return callback


def host_memory() -> Iterable[Observation]:
    info: dict[str, int] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        info[name] = int(rest.split()[0]) * 1024
    used = info["MemTotal"] - info.get("MemAvailable", info.get("MemFree", 0))
    return [
        Observation(used, {"system.memory.state": "used"}),
        Observation(info["MemTotal"] - used, {"system.memory.state": "free"}),
    ]


class CpuUtilisation:
    """Share of CPU time not idle since the previous reading, from /proc/stat."""

    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None

    def __call__(self) -> Iterable[Observation]:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle, total = fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields)
        last, self._last = self._last, (idle, total)
        if last is None or total == last[1]:
            return []
        return [Observation(1.0 - (idle - last[0]) / (total - last[1]))]


class Nvml:
    """GPU gauges through NVML (nvidia-ml-py, the `gpu` extra); nothing at all where it is missing."""

    def __init__(self) -> None:
        self.handles: list[tuple[str, Any]] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            for index in range(pynvml.nvmlDeviceGetCount()):
                self.handles.append((str(index), pynvml.nvmlDeviceGetHandleByIndex(index)))
            self.nvml: Any = pynvml
        except Exception:  # no library, no driver, no GPU: no GPU gauges
            self.handles = []

    def memory(self, field: str) -> Iterable[Observation]:
        for gpu_id, handle in self.handles:
            info = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            yield Observation(info.used if field == "used" else info.total, {"hw.id": gpu_id, "hw.type": "gpu"})

    def utilisation(self) -> Iterable[Observation]:
        for gpu_id, handle in self.handles:
            rates = self.nvml.nvmlDeviceGetUtilizationRates(handle)
            yield Observation(rates.gpu / 100.0, {"hw.id": gpu_id, "hw.type": "gpu"})

    def temperature(self) -> Iterable[Observation]:
        for gpu_id, handle in self.handles:
            celsius = self.nvml.nvmlDeviceGetTemperature(handle, self.nvml.NVML_TEMPERATURE_GPU)
            yield Observation(celsius, {"hw.id": gpu_id, "hw.type": "gpu"})


def register_probes(meter: Meter) -> None:
    meter.create_observable_gauge("system.memory.usage", callbacks=[_safe(host_memory)], unit="By")
    meter.create_observable_gauge("system.cpu.utilization", callbacks=[_safe(CpuUtilisation())], unit="1")
    gpu = Nvml()
    if not gpu.handles:
        return
    meter.create_observable_gauge("hw.gpu.memory.usage", callbacks=[_safe(lambda: gpu.memory("used"))], unit="By")
    meter.create_observable_gauge("hw.gpu.memory.limit", callbacks=[_safe(lambda: gpu.memory("total"))], unit="By")
    meter.create_observable_gauge("hw.gpu.utilization", callbacks=[_safe(gpu.utilisation)], unit="1")
    meter.create_observable_gauge("hw.temperature", callbacks=[_safe(gpu.temperature)], unit="Cel")
