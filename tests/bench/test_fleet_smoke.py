"""The fleet simulator (`bench/fleet.py`) at 50 agents for a few seconds: CI's smoke test of the simulator and of
what a fleet does to one control plane on SQLite. Real processes on loopback (a control plane, a cloud-role agent
behind its gateway), real SDK exports, policy polls, overflow and a fleet-wide firing; invariants only, no timing."""

from __future__ import annotations

from pathlib import Path

from bench import fleet

AGENTS = 50


def test_fifty_agents_are_answered_and_counted_exactly(tmp_path: Path) -> None:
    options = fleet.parse_args(["--agents", str(AGENTS), "--seconds", "4", "--warmup", "2", "--export-interval", "2",
                                "--poll-interval", "2", "--loop-interval", "1", "--templates", "4",
                                "--overflow-share", "0.01"])  # fmt: skip
    result, _ = fleet.run_fleet(options, AGENTS, tmp_path)

    # Every export answered 200 (none refused for load, none failed), once each: no retry was needed.
    assert result.export_statuses == {"200": result.exports_sent}, (result.export_statuses, result.errors)
    assert result.exports_sent >= 2 * AGENTS
    # What the database holds per agent is its last acknowledged export's cumulative values: nothing lost or twice.
    assert result.consistent, result.consistency
    # Polls: answered 200 (the first, and a new document) or 304 (If-None-Match matched); nothing else.
    assert set(result.poll_statuses) <= {"200", "304"} and result.poll_statuses.get("304", 0) > 0, result.poll_statuses
    # The fleet-wide rule fires at most once per agent; the overflow went through the gateway and answered 200.
    assert result.fired_events <= AGENTS
    assert result.infers > 0 and result.infer_errors == 0, result.errors
