"""Overflow end to end, with real processes on loopback: a control plane (its gateway), an edge agent whose
capacity is deliberately small, and cloud backends that are Spillway agents in cloud role.

Under a load that exceeds the device's capacity, with a cloud backend killed and restarted, every request sent
gets exactly one answer with an outcome, and the client's counts, the agent's counts and the phases agree.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from spillway.demo.overflow_story import OUTCOMES, LoadPhase, OverflowStory, small_repository
from spillway.demo.story import Story
from tests.utils.server import free_ports

pytestmark = pytest.mark.slow


def test_overflow_story_every_request_answered_once_high_priorities_protected(tmp_path: Path) -> None:
    models = small_repository(tmp_path / "slow")
    port, agent_port, edge_port, *cloud_ports = free_ports(5)
    with Story(tmp_path / "story", port=port, agent_port=agent_port, interval_s=1.0) as base:
        base.prepare()
        base.start_control_plane()
        story = OverflowStory(base, models=models, edge_port=edge_port, cloud_ports=cloud_ports)
        story.start()
        # Measured on the spot: the phases offer multiples of it, and the deadline is five service times of it.
        capacity = story.calibrate(seconds=1.5)
        assert capacity > 0, "the small agent answered nothing in its capacity probe"
        probed = story.edge_outcomes()
        one, two = story.clouds

        def back() -> None:
            one.start()
            one.wait()
            story.wait_backend_usable(one.name)

        def both_down() -> None:
            one.kill()
            two.kill()

        phases = story.run([
            LoadPhase("normal", 0.4 * capacity, 2.0),
            LoadPhase("burst", 3 * capacity, 4.0),
            LoadPhase("one cloud down", 3 * capacity, 3.0, before=one.kill),
            LoadPhase("one back", 3 * capacity, 3.0, before=back),
            LoadPhase("all clouds down", 3 * capacity, 4.0, before=both_down),
            LoadPhase("calm", 0.4 * capacity, 2.0),
        ])  # fmt: skip
        by_name = {p.name: p for p in phases}
        report = "; ".join(f"{p.name}: {dict(p.outcomes())} {dict(p.reasons())}" for p in phases)

        # Nothing lost: every request sent has exactly one answer, and each answer names a known outcome.
        for phase in phases:
            assert len(phase.answers) == phase.sent, report
            assert set(phase.outcomes()) <= set(OUTCOMES), report
        # The agent counted the same requests with the same outcomes.
        seen = story.edge_outcomes()
        seen.subtract(probed)
        sent: Counter[str] = Counter()
        for phase in phases:
            sent.update(phase.outcomes())
        assert +seen == sent, report

        # What each phase is about. The thresholds are loose on purpose: everything shares 2 cores here (the
        # agents' compute threads, the gateway, the load generator), so the shares move from run to run;
        # bench/overflow.py measures them.
        normal = by_name["normal"].outcomes()
        assert normal["local"] >= 0.9 * by_name["normal"].sent, report
        burst = by_name["burst"]
        assert burst.outcomes()["overflow"] > 0, report  # the cloud took part of the burst
        high = [a for a in burst.answers if a.priority == 1]
        low = [a for a in burst.answers if a.priority == 2]
        high_local = sum(a.outcome == "local" for a in high) / len(high)
        low_local = sum(a.outcome == "local" for a in low) / len(low)
        assert high_local > low_local, report  # high priority is served locally first
        # One backend down: the gateway sends to the other; overflow goes on.
        assert by_name["one cloud down"].outcomes()["overflow"] > 0, report
        # Both down: the agent's fallbacks answer (cached answers, the async queue), and nothing overflows.
        down = by_name["all clouds down"]
        assert down.outcomes()["fallback_cache"] + down.outcomes()["queued_async"] > 0, report
        assert down.outcomes()["error"] == 0, report
        assert by_name["calm"].outcomes()["local"] >= 0.9 * by_name["calm"].sent, report

        gateway = {b["name"]: b for b in story.gateway()}
        assert gateway["cloud-1"]["requests"] > 0 and gateway["cloud-2"]["requests"] > 0
        events = [e["kind"] for e in base.events()]
        assert "backend.ejected" in events or "backend.unhealthy" in events
