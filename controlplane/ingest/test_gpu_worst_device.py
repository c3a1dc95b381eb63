"""For tests/controlplane/test_rules_engine.py: GPU memory conditions judge the worst device."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from controlplane.db.models import utcnow
from controlplane.rules.observe import AgentGauges, read_gauges
from spillway.contract import names
from tests.utils.rollups import add_gauge

GiB = 2**30


def test_gpu_memory_conditions_see_the_worst_device_not_the_sum(factory: Any) -> None:
    """Two GPUs and a MIG device (each its `hw.id`): summed, 46 GiB of 96 would be free; a model loads on one device,
    and the fullest has 1 GiB (by bytes) or 5 % (by share) free. Readings without `hw.id` are one device."""
    now = utcnow().replace(second=30, microsecond=0)
    minute = now.replace(second=0)
    with factory() as session, session.begin():
        for device, used, limit in (("0", 79, 80), ("1", 5, 16), ("MIG-1", 9.5, 10)):
            add_gauge(session, "multi", minute, names.GPU_MEMORY_USAGE, used * GiB, **{"hw.id": device})
            add_gauge(session, "multi", minute, names.GPU_MEMORY_LIMIT, limit * GiB, **{"hw.id": device})
        add_gauge(session, "multi", minute - timedelta(minutes=1), names.GPU_MEMORY_USAGE, 1 * GiB, **{"hw.id": "0"})
        add_gauge(session, "anon", minute, names.GPU_MEMORY_USAGE, 6 * GiB, **{"hw.type": "gpu"})
        add_gauge(session, "anon", minute, names.GPU_MEMORY_LIMIT, 8 * GiB, **{"hw.type": "gpu"})
        add_gauge(session, "half", minute, names.GPU_MEMORY_USAGE, 6 * GiB, **{"hw.id": "0"})  # no limit read
    with factory() as session:
        gauges = read_gauges(session, now)
    multi = gauges["multi"]
    assert multi.value("gpu_memory_free_bytes", None) == 0.5 * GiB  # MIG-1: 0.5 GiB (GPU 0: 1 GiB)
    assert multi.value("gpu_memory_free_ratio", None) == pytest.approx(1 / 80)  # GPU 0: 1 of 80 GiB
    assert multi.details("gpu_memory_free_ratio", None) == {
        "device": "0", "gpu_memory_used": 79 * GiB, "gpu_memory_limit": 80 * GiB, "devices": 3}  # fmt: skip
    assert multi.details("gpu_memory_free_bytes", None)["device"] == "MIG-1"
    assert gauges["anon"].value("gpu_memory_free_bytes", None) == 2 * GiB
    assert gauges["anon"].value("gpu_memory_free_ratio", None) == 0.25
    assert gauges["anon"].details("gpu_memory_free_ratio", None)["device"] is None
    assert gauges["half"].value("gpu_memory_free_ratio", None) is None  # a device without both readings: none
    assert AgentGauges().value("gpu_memory_free_bytes", None) is None and AgentGauges().details(
        "gpu_memory_free_bytes", None) == {}  # fmt: skip
