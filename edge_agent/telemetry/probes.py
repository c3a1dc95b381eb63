"""Device gauges, all optional and failing soft: host CPU and memory from /proc; GPU memory, utilisation and
temperature through NVML where present, else on a Jetson through jetson-stats' `jtop` service (names from the
OpenTelemetry hardware and system conventions)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from edge_agent.runtime.devices import is_jetson, load_nvml, mig_devices, read_meminfo

log = logging.getLogger("spillway.agent.telemetry")

# The GPU gauges and their units, the same from NVML and from jtop.
GPU_GAUGES = {
    "hw.gpu.memory.usage": "By",
    "hw.gpu.memory.limit": "By",
    "hw.gpu.utilization": "1",
    "hw.temperature": "Cel",
}
GPU_DESCRIPTIONS = {
    "hw.gpu.memory.usage": "GPU memory in use (on a Jetson: the RAM it shares with the CPU)",
    "hw.gpu.memory.limit": "GPU memory in all (on a Jetson: the RAM it shares with the CPU)",
    "hw.gpu.utilization": "share of time the GPU was busy",
    "hw.temperature": "temperature of a GPU or board sensor",
}


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
    """Share of CPU time not idle since the previous reading, from /proc/stat. Readings closer than `min_window_s`
    (a scrape of /metrics just after an OTLP export reads the gauge too) repeat the last value instead of measuring
    a sliver of time."""

    def __init__(self, min_window_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._last: tuple[int, int, float] | None = None
        self._value: float | None = None
        self._min_window_s = min_window_s
        self._clock = clock

    def __call__(self) -> Iterable[Observation]:
        now = self._clock()
        if self._last is not None and now - self._last[2] < self._min_window_s:
            return [] if self._value is None else [Observation(self._value)]
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle, total = fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields)
        last, self._last = self._last, (idle, total, now)
        if last is not None and total != last[1]:
            self._value = 1.0 - (idle - last[0]) / (total - last[1])
        return [] if self._value is None else [Observation(self._value)]


class Nvml:
    """GPU gauges through NVML (nvidia-ml-py, the `gpu` extra), per GPU and per MIG device of a GPU in MIG mode;
    nothing at all where NVML is missing. A GPU's `hw.id` is its NVML index; a MIG device's is its UUID (`MIG-...`,
    what CUDA_VISIBLE_DEVICES names it by), with `hw.parent` its GPU's index (OpenTelemetry's hardware conventions).
    The memory gauges of a GPU in MIG mode are its MIG devices'; its utilisation and temperature are the GPU's (a MIG
    device has none of its own). A device that cannot answer one reading is left out of that reading alone."""

    def __init__(self, load: Callable[[], Any] = load_nvml) -> None:
        self.handles: list[tuple[str, Any]] = []
        try:
            nvml = load()
            nvml.nvmlInit()
            for index in range(nvml.nvmlDeviceGetCount()):
                self.handles.append((str(index), nvml.nvmlDeviceGetHandleByIndex(index)))
            self.nvml: Any = nvml
        except Exception:  # no library, no driver, no GPU: no GPU gauges
            self.handles = []

    def devices(self, *, mig: bool = True) -> Iterator[tuple[dict[str, str], Any]]:
        """(attributes, handle) of each GPU or, with `mig`, in place of a GPU in MIG mode each of its MIG devices
        (looked up at every reading: MIG devices are made and destroyed while the agent runs). In place of: the GPU's
        own reading would count its MIG devices' memory a second time in a sum over devices."""
        for gpu_id, handle in self.handles:
            slices = mig_devices(self.nvml, handle) if mig else []
            if not slices:
                yield {"hw.id": gpu_id, "hw.type": "gpu"}, handle
            for uuid, device in slices:
                yield {"hw.id": uuid, "hw.type": "gpu", "hw.parent": gpu_id}, device

    def _each(self, read: Callable[[Any], float], *, mig: bool) -> Iterable[Observation]:
        readings = []
        for attributes, handle in self.devices(mig=mig):
            try:
                readings.append(Observation(read(handle), attributes))
            except Exception:  # NVMLError_NotSupported and friends: this device, this reading
                log.debug("NVML reading of %s failed", attributes["hw.id"], exc_info=True)
        return readings

    def memory(self, field: str) -> Iterable[Observation]:
        def read(handle: Any) -> float:
            info = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            return float(info.used if field == "used" else info.total)

        return self._each(read, mig=True)

    def utilisation(self) -> Iterable[Observation]:
        return self._each(lambda handle: self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0, mig=False)

    def temperature(self) -> Iterable[Observation]:
        temperature = self.nvml.NVML_TEMPERATURE_GPU
        return self._each(lambda handle: self.nvml.nvmlDeviceGetTemperature(handle, temperature), mig=False)


def shared_memory(meminfo: Path = Path("/proc/meminfo")) -> dict[str, list[Observation]]:
    """A Jetson's GPU memory without jetson-stats: the board's RAM, which its GPU allocates from (usage: what CPU and
    GPU use together, MemTotal - MemAvailable; limit: MemTotal), as GPU `0`, the device its sessions run on."""
    fields = read_meminfo(meminfo)
    if "MemTotal" not in fields or "MemAvailable" not in fields:
        return {"hw.gpu.memory.usage": [], "hw.gpu.memory.limit": []}
    attributes = {"hw.id": "0", "hw.type": "gpu"}
    return {
        "hw.gpu.memory.usage": [Observation(fields["MemTotal"] - fields["MemAvailable"], attributes)],
        "hw.gpu.memory.limit": [Observation(fields["MemTotal"], attributes)],
    }


# jetson-stats (jtop) 4.x, as documented in the docstrings of `jtop.gpu`, `jtop.memory` and `jtop.temperature`
# (jtop/jtop.py of rbonghi/jetson_stats, rendered at https://rnext.it/jetson_stats/reference/jtop.html) and
# produced by the services behind them (jtop/core/gpu.py, memory.py, temperature.py):
# - gpu[name] = {"type": "integrated" | "discrete", "status": {"load": percent 0..100, ...}, "freq": ...}; the
#   load is the sysfs `load` / 10 (igpu_read_status), NVML's rates.gpu is a percent too: both become a ratio.
# - memory["RAM"] = {"tot", "used", "free", "buffers", "cached", "shared", "lfb"}, sizes in kB straight from
#   /proc/meminfo (MemoryService.get_status), that is KiB. A Jetson GPU has no memory of its own: it allocates
#   from this RAM, next to the CPU, so the limit is RAM "tot" and the usage is RAM "used" (CPU and GPU
#   together), which keeps limit - usage the room a model load really has. "shared" (NvMapMemUsed, the GPU's
#   own part) is not used: boards without nvmap (Thor, rbonghi/jetson_stats#849) lack it and jtop fills in
#   something else there.
# - temperature[name] = {"temp": °C, "online": bool, "max"/"crit" where the sensor has them}; an unreadable
#   sensor reads -256 and online False (TemperatureService.get_status).
# This is checked against those documented shapes only, not on a board.
JTOP_OFFLINE_CELSIUS = -256
JTOP_OPEN_TIMEOUT_S = 5.0  # jtop's own first read waits up to 3 s (TIMEOUT_GAIN x its 1 s interval)


def jtop_readings(
    gpu: Mapping[str, Any], memory: Mapping[str, Any], temperature: Mapping[str, Any]
) -> dict[str, list[Observation]]:
    """One jtop 4.x reading (`jetson.gpu`, `jetson.memory`, `jetson.temperature`) as the GPU gauges' observations."""
    readings: dict[str, list[Observation]] = {name: [] for name in GPU_GAUGES}
    ram = memory.get("RAM")
    for name, state in gpu.items():
        attributes = {"hw.id": name, "hw.type": "gpu"}
        load = state.get("status", {}).get("load")
        if load is not None:
            readings["hw.gpu.utilization"].append(Observation(load / 100.0, attributes))
        if state.get("type") == "integrated" and ram:
            readings["hw.gpu.memory.usage"].append(Observation(ram["used"] * 1024, attributes))
            readings["hw.gpu.memory.limit"].append(Observation(ram["tot"] * 1024, attributes))
    for name, sensor in temperature.items():
        celsius = sensor.get("temp")
        if celsius is None or not sensor.get("online", True) or celsius <= JTOP_OFFLINE_CELSIUS:
            continue
        attributes = {"hw.id": name, "hw.type": "temperature", "hw.sensor_location": name}
        readings["hw.temperature"].append(Observation(celsius, attributes))
    return readings


class Jtop:
    """GPU gauges on a Jetson through the jetson-stats service (`jtop`, the `jetson` extra), which it reaches
    over /run/jtop.sock.

    The client is made and started in a daemon thread, so a missing, stopped or hung service never delays the
    agent (jtop's start() has no overall bound: its configuration handshake loops until the service answers).
    Until it is open the gauges read nothing; if it is still not open when a reading comes after
    `open_timeout_s`, the probe gives up for good (one log line) and closes a client that opens later. A client
    that fails later (the service restarted or stopped) is given up the same way: no reconnection."""

    def __init__(
        self,
        make_client: Callable[[], Any],
        open_timeout_s: float = JTOP_OPEN_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._deadline = clock() + open_timeout_s
        self._open_timeout_s = open_timeout_s
        self._lock = threading.Lock()
        self._client: Any = None
        self._state = "opening"  # then "open" or "gone", never back
        self.settled = threading.Event()  # set once the opening thread has finished, either way
        threading.Thread(target=self._open, args=(make_client,), name="spillway-jtop-open", daemon=True).start()

    def _open(self, make_client: Callable[[], Any]) -> None:
        try:
            client = make_client()
            client.start()
        except Exception as error:  # JtopException (service not active, no permission, version mismatch), OSError
            self._give_up(f"jtop unavailable ({_one_line(error)}); no Jetson GPU gauges")
            self.settled.set()
            return
        with self._lock:
            late = self._state != "opening"
            if not late:
                self._client, self._state = client, "open"
        if late:
            _close(client)
        else:
            log.info("Jetson GPU gauges through jtop")
        self.settled.set()

    def _give_up(self, message: str) -> None:
        """Stop for good, logging the reason once however many readings or threads notice."""
        with self._lock:
            first, self._state = self._state != "gone", "gone"
        if first:
            log.warning(message)

    def _ready(self) -> Any:
        with self._lock:
            state, client = self._state, self._client
        if state == "opening" and self._clock() >= self._deadline:
            self._give_up(f"jtop did not answer within {self._open_timeout_s:g} s; no Jetson GPU gauges")
        if state != "open":
            return None
        try:
            alive = client.ok(spin=True)  # never blocks; re-raises what stopped jtop's reading thread
        except Exception as error:
            alive, reason = False, _one_line(error)
        else:
            reason = "its reading thread stopped"
        if not alive:
            self._give_up(f"jtop stopped answering ({reason}); no Jetson GPU gauges from now on")
            return None
        return client

    def read(self, metric: str) -> list[Observation]:
        client = self._ready()
        if client is None:
            return []
        return jtop_readings(client.gpu, client.memory, client.temperature)[metric]


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _close(client: Any) -> None:
    try:
        client.close()
    except Exception:
        log.debug("closing jtop failed", exc_info=True)


def open_jtop(open_timeout_s: float = JTOP_OPEN_TIMEOUT_S, clock: Callable[[], float] = time.monotonic) -> Jtop | None:
    """The Jetson probe where jetson-stats is installed (it opens in the background); None where it is not."""
    try:
        from jtop import jtop
    except Exception as error:  # ImportError off a Jetson or without the `jetson` extra; anything from a bad install
        log.info("no GPU gauges: neither NVML nor jetson-stats (jtop) is available (%s)", _one_line(error))
        return None
    return Jtop(jtop, open_timeout_s, clock)


def register_probes(meter: Meter, *, nvml: Nvml | None = None, jetson: bool | None = None) -> None:
    """The host gauges, and the GPU gauges from NVML, else jtop on a Jetson, else (a Jetson without jetson-stats)
    its shared RAM as GPU memory."""
    meter.create_observable_gauge("system.memory.usage", callbacks=[_safe(host_memory)], unit="By",
                                  description="host memory by state (used, free)")  # fmt: skip
    meter.create_observable_gauge("system.cpu.utilization", callbacks=[_safe(CpuUtilisation())], unit="1",
                                  description="share of CPU time not idle")  # fmt: skip
    readers: dict[str, Callable[[], Iterable[Observation]]]
    nvml = nvml or Nvml()
    if nvml.handles:
        readers = {
            "hw.gpu.memory.usage": lambda: nvml.memory("used"),
            "hw.gpu.memory.limit": lambda: nvml.memory("total"),
            "hw.gpu.utilization": nvml.utilisation,
            "hw.temperature": nvml.temperature,
        }
    else:  # no NVML: a Jetson, or no NVIDIA GPU at all
        board = open_jtop()
        if board is not None:
            readers = {name: partial(board.read, name) for name in GPU_GAUGES}
        elif jetson if jetson is not None else is_jetson():
            log.info("Jetson GPU memory gauges from /proc/meminfo (the RAM its GPU shares)")
            readers = {name: partial(lambda n: shared_memory()[n], name) for name in GPU_GAUGES if "memory" in name}
        else:
            return
    for name, reader in readers.items():
        meter.create_observable_gauge(name, callbacks=[_safe(reader)], unit=GPU_GAUGES[name],
                                      description=GPU_DESCRIPTIONS[name])  # fmt: skip
