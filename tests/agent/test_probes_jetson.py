"""The Jetson GPU gauges through jetson-stats (`jtop`): jtop 4.x readings mapped to the OpenTelemetry hw.* gauges,
and a jtop that is missing, refuses to open, hangs or fails while read costing the agent nothing.

No board and no jetson-stats here: a hand-written stand-in for `jtop.jtop` is put in `sys.modules`, and NVML is
hidden, so that the probe takes its Jetson path on any machine (the GPU test machine included). The readings
are shaped as jetson-stats 4.x documents and produces them (below); that is all this verifies: the Jetson path
has not run against a real jtop service on a board."""

from __future__ import annotations

import logging
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from edge_agent.scheduling.stats import ModelStats
from edge_agent.telemetry import AgentTelemetry, TelemetrySettings
from edge_agent.telemetry.probes import jtop_readings, open_jtop

# One reading as jetson-stats 4.x hands it out, shapes taken from rbonghi/jetson_stats: the docstrings of the
# `jtop.gpu`, `jtop.memory` and `jtop.temperature` properties in jtop/jtop.py (rendered at
# https://rnext.it/jetson_stats/reference/jtop.html) and what the services behind them return:
# GPUService.get_status with igpu_read_status/igpu_read_freq (jtop/core/gpu.py; "load" is the sysfs load / 10,
# a percent), MemoryService.get_status (jtop/core/memory.py; RAM and SWAP in kB from /proc/meminfo, EMC from
# read_emc), TemperatureService.get_status (jtop/core/temperature.py; °C, -256 and online False when a sensor
# cannot be read). Keys as there; the values are made up for an Orin Nano-like board, not captured from one.
GPU = {
    "ga10b": {
        "type": "integrated",
        "status": {"railgate": False, "tpc_pg_mask": False, "3d_scaling": True, "load": 37.4},
        "freq": {"governor": "nvhost_podgov", "cur": 624750, "max": 624750, "min": 306000, "GPC": [624750]},
        "power_control": "auto",
    }
}
MEMORY = {
    "RAM": {"tot": 7451176, "used": 3212408, "free": 2185492, "buffers": 98164, "cached": 1955112,
            "shared": 612340, "lfb": 213},
    "SWAP": {"tot": 3725576, "used": 10240, "cached": 512,
             "table": {"/dev/zram0": {"type": "zram", "prio": 5, "size": 620928, "used": 1708, "boot": False}}},
    "EMC": {"cur": 2133000, "max": 2133000, "min": 204000, "override": 0, "val": 4, "online": True},
}  # fmt: skip
TEMPERATURE = {
    "cpu": {"temp": 48.5, "online": True},
    "cv0": {"temp": -256, "online": False},
    "gpu": {"temp": 47.0, "online": True},
    "soc0": {"temp": 46.8, "online": True},
    "tj": {"temp": 48.5, "online": True},
}
HW = ("hw.gpu.memory.usage", "hw.gpu.memory.limit", "hw.gpu.utilization", "hw.temperature")


class FakeJtop:
    """Stands in for jtop 4.x's `jtop` client: start(), ok(spin), close() and the three readings the probe uses."""

    def __init__(self, start: Callable[[], None] = lambda: None) -> None:
        self._start = start
        self.running = False
        self.closed = False
        self.error: Exception | None = None  # what jtop's reading thread stopped on, re-raised by ok()
        self.gpu: Any = GPU
        self.memory: Any = MEMORY
        self._temperature: Any = TEMPERATURE

    @property
    def temperature(self) -> Any:
        if isinstance(self._temperature, Exception):
            raise self._temperature
        return self._temperature

    def start(self) -> None:
        self._start()
        self.running = True

    def ok(self, spin: bool = False) -> bool:
        if self.error is not None:
            raise self.error
        return self.running

    def close(self) -> None:
        self.closed, self.running = True, False


class JtopException(Exception):
    """jtop's own exception, as jtop/core/exceptions.py defines it."""


@pytest.fixture
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError, as on a Jetson


def install_jtop(monkeypatch: pytest.MonkeyPatch, make_client: Callable[[], Any]) -> None:
    module = types.ModuleType("jtop")
    module.jtop = make_client
    monkeypatch.setitem(sys.modules, "jtop", module)


def points(reader: InMemoryMetricReader) -> dict[str, tuple[str, list[Any]]]:
    """name -> (unit, data points) for every metric that has points."""
    data = reader.get_metrics_data()
    assert data is not None
    return {metric.name: (metric.unit, list(metric.data.data_points))
            for rm in data.resource_metrics for sm in rm.scope_metrics for metric in sm.metrics}  # fmt: skip


def telemetry_with(reader: InMemoryMetricReader) -> AgentTelemetry:
    return AgentTelemetry(TelemetrySettings(agent_id="jetson-1", device_class="jetson"), readers=[reader])


def serves(telemetry: AgentTelemetry, reader: InMemoryMetricReader) -> dict[str, tuple[str, list[Any]]]:
    """Record one answered request and read every gauge: the agent's own metrics are always there."""
    ModelStats(listener=telemetry.recorder("mlp", 1)).request(1, "local", 0.001, 0.002, 0.004)
    found = points(reader)
    assert found["spillway.requests"][1][0].value >= 1
    assert "system.memory.usage" in found
    return found


def warnings_from(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "spillway.agent.telemetry" and r.levelno >= 30]


def test_a_jtop_4_reading_maps_to_the_hw_gauges_in_opentelemetry_units() -> None:
    readings = jtop_readings(GPU, MEMORY, TEMPERATURE)

    gpu = {"hw.id": "ga10b", "hw.type": "gpu"}
    (utilisation,) = readings["hw.gpu.utilization"]
    assert utilisation.value == pytest.approx(0.374) and utilisation.attributes == gpu  # percent -> ratio
    (usage,) = readings["hw.gpu.memory.usage"]
    (limit,) = readings["hw.gpu.memory.limit"]
    assert (usage.value, usage.attributes) == (3212408 * 1024, gpu)  # shared RAM, kB -> bytes
    assert (limit.value, limit.attributes) == (7451176 * 1024, gpu)
    temperatures = {o.attributes["hw.id"]: (o.value, o.attributes) for o in readings["hw.temperature"]}
    assert set(temperatures) == {"cpu", "gpu", "soc0", "tj"}  # cv0 is offline (-256): no reading
    assert temperatures["gpu"] == (47.0, {"hw.id": "gpu", "hw.type": "temperature", "hw.sensor_location": "gpu"})


def test_through_the_agent_telemetry_the_jetson_gauges_carry_their_names_units_and_values(
    monkeypatch: pytest.MonkeyPatch, no_nvml: None
) -> None:
    clients: list[FakeJtop] = []
    install_jtop(monkeypatch, lambda: clients.append(FakeJtop()) or clients[-1])
    reader = InMemoryMetricReader()
    telemetry = telemetry_with(reader)
    deadline = time.monotonic() + 10
    while not (clients and clients[0].running) and time.monotonic() < deadline:
        time.sleep(0.01)  # the client opens in its own thread; poll with a deadline

    found = serves(telemetry, reader)
    assert {name: found[name][0] for name in HW} == {
        "hw.gpu.memory.usage": "By", "hw.gpu.memory.limit": "By", "hw.gpu.utilization": "1", "hw.temperature": "Cel"
    }  # fmt: skip
    assert found["hw.gpu.memory.limit"][1][0].value == 7451176 * 1024
    assert found["hw.gpu.utilization"][1][0].value == pytest.approx(0.374)
    celsius = {p.attributes["hw.sensor_location"]: p.value for p in found["hw.temperature"][1]}
    assert celsius == {"cpu": 48.5, "gpu": 47.0, "soc0": 46.8, "tj": 48.5}
    telemetry.shutdown()


def test_without_jtop_there_are_no_gpu_gauges_and_serving_is_unaffected(
    monkeypatch: pytest.MonkeyPatch, no_nvml: None, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "jtop", None)  # `from jtop import jtop` raises ImportError
    caplog.set_level(logging.INFO, logger="spillway.agent.telemetry")
    reader = InMemoryMetricReader()
    started = time.monotonic()
    telemetry = telemetry_with(reader)
    assert time.monotonic() - started < 2

    found = serves(telemetry, reader)
    assert not set(HW) & set(found)
    said = [r.getMessage() for r in caplog.records if r.name == "spillway.agent.telemetry"]
    assert len(said) == 1 and "neither NVML nor jetson-stats" in said[0]
    telemetry.shutdown()


def _refused() -> None:
    raise JtopException("The jtop.service is not active. Please run:\nsudo systemctl restart jtop.service")


def _no_client() -> FakeJtop:
    raise PermissionError(13, "Permission denied")


@pytest.mark.parametrize("make_client", [lambda: FakeJtop(start=_refused), _no_client], ids=["start", "client"])
def test_a_jtop_that_raises_on_open_fails_soft_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, no_nvml: None, caplog: pytest.LogCaptureFixture,
    make_client: Callable[[], FakeJtop],
) -> None:  # fmt: skip
    install_jtop(monkeypatch, make_client)
    probe = open_jtop()
    assert probe is not None and probe.settled.wait(10)
    assert all(probe.read(name) == [] for name in HW)

    reader = InMemoryMetricReader()
    telemetry = telemetry_with(reader)
    deadline = time.monotonic() + 10
    while len(warnings_from(caplog)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(2):
        assert not set(HW) & set(serves(telemetry, reader))
    said = warnings_from(caplog)
    assert len(said) == 2  # one line for each of the two probes above, and no more however often it is read
    assert all(m.startswith("jtop unavailable (") and "\n" not in m for m in said)
    telemetry.shutdown()


def test_a_jtop_that_fails_while_read_fails_soft(
    monkeypatch: pytest.MonkeyPatch, no_nvml: None, caplog: pytest.LogCaptureFixture
) -> None:
    client = FakeJtop()
    install_jtop(monkeypatch, lambda: client)
    reader = InMemoryMetricReader()
    telemetry = telemetry_with(reader)
    deadline = time.monotonic() + 10
    while not client.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "hw.temperature" in serves(telemetry, reader)

    client._temperature = KeyError("temperature")  # one bad reading: that collection has no GPU gauges...
    assert not set(HW) & set(serves(telemetry, reader))
    client._temperature = TEMPERATURE  # ...and the next one is whole again
    assert set(HW) <= set(serves(telemetry, reader))

    client.error = JtopException("Lost connection with jtop server")  # jtop's reading thread has stopped
    assert not set(HW) & set(serves(telemetry, reader))
    client.error = None
    assert not set(HW) & set(serves(telemetry, reader))  # given up for good, not read stale
    assert warnings_from(caplog) == ["jtop stopped answering (Lost connection with jtop server); "
                                     "no Jetson GPU gauges from now on"]  # fmt: skip
    telemetry.shutdown()


@pytest.mark.parametrize("late", ["answers", "fails"])
def test_a_hung_jtop_never_delays_the_agent_and_is_given_up_after_the_open_timeout(
    monkeypatch: pytest.MonkeyPatch, no_nvml: None, caplog: pytest.LogCaptureFixture, late: str
) -> None:
    clients: list[tuple[FakeJtop, threading.Event]] = []

    def hung() -> FakeJtop:
        answer = threading.Event()

        def start() -> None:
            answer.wait(30)
            if late == "fails":
                raise JtopException("Lost connection with jtop server")

        clients.append((FakeJtop(start=start), answer))
        return clients[-1][0]

    install_jtop(monkeypatch, hung)
    now = [100.0]
    started = time.monotonic()
    probe = open_jtop(open_timeout_s=5, clock=lambda: now[0])
    assert time.monotonic() - started < 2
    deadline = time.monotonic() + 10
    while not clients and time.monotonic() < deadline:
        time.sleep(0.01)  # the probe's client is made in its opening thread
    ((client, answer),) = clients
    reader = InMemoryMetricReader()
    started = time.monotonic()
    telemetry = telemetry_with(reader)  # its own probe, with the real clock, hangs the same way
    assert time.monotonic() - started < 2
    assert not set(HW) & set(serves(telemetry, reader))
    assert probe is not None and probe.read("hw.temperature") == [] and warnings_from(caplog) == []

    now[0] += 5
    assert probe.read("hw.temperature") == [] and probe.read("hw.gpu.utilization") == []
    assert warnings_from(caplog) == ["jtop did not answer within 5 s; no Jetson GPU gauges"]

    answer.set()  # the service answers (or fails) at last: a late client is closed, not used; no second line
    assert probe.settled.wait(10)
    assert client.closed == (late == "answers") and probe.read("hw.temperature") == []
    assert warnings_from(caplog) == ["jtop did not answer within 5 s; no Jetson GPU gauges"]
    telemetry.shutdown()
    for _, other in clients:
        other.set()
