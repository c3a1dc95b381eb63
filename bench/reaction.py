"""How fast the control loop reacts: breach onset -> policy applied at the agent, and recovery, with real
processes on loopback (spillway/demo/story.py: a control plane, an agent on the demo models, the rule
`lite-when-queue-deep`); what one control-loop cycle costs for 1,000 agents x 10 rules, a fleet-wide firing
included (bench/slo_eval.py); and what the agents' policy poll costs the control plane on its 304 path.

Each round: 3 s calm (one client), a surge (32 closed-loop clients) until the agent answers from the lite
variant (or 20 s), then calm until it answers from version 1 again (or 30 s).
- reaction = first answer from version 2 - start of the surge (the queue is deep from the surge's first
  second: breach onset); it spans the agent's export, the loop's cycle and the agent's poll;
- recovery = first answer from version 1 - start of the calm, which includes the rule's `recover_after` (8 s).
Target (issue 5): reaction <= 2 x (export interval + poll interval + `for`) = 2 x (1 + 1 + 0) s = 4 s.

    .venv/bin/python bench/reaction.py --rounds 5 --write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import LUA, WrkResult, free_port, median, run_wrk, write_docs
from bench.slo_eval import run as evaluator_run
from spillway.demo.models import build_demo_repository
from spillway.demo.story import INTERVAL_S, RULE, Phase, Story

MARK_BEGIN, MARK_END = "<!-- bench/reaction.py: begin -->", "<!-- bench/reaction.py: end -->"


async def _until(story: Story, clients: int, want: str, limit_s: float) -> tuple[float | None, Phase]:
    """Run `clients` until an answer comes from version `want`; seconds from the phase's start, or None."""
    (phase,) = await story.ramp([Phase(f"until v{want}", clients, limit_s, until=want)])
    return next((s.at for s in phase.samples if s.version == want), None), phase  # `at`: from the phase's start


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def poll_cost(story: Story, root: Path, seconds: int) -> dict[str, Any]:
    """The agent's policy poll as the fleet sends it (its token, `If-None-Match` with the current ETag: a 304), closed
    loop (wrk, one thread, 4 connections) against the story's control plane: rate, latency, and the control plane's
    CPU per poll."""
    import httpx

    url = f"{story.base}/api/v1/agents/{story.agent_id}/policy"
    auth = {"Authorization": f"Bearer {story.agent_token}"}
    etag = httpx.get(url, headers=auth, timeout=10).headers["etag"]
    headers = "\n".join(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}"
                        for k, v in {**auth, "If-None-Match": etag}.items())  # fmt: skip
    lua = root / "poll.lua"
    done = LUA.split("function done", 1)[1].replace("{{", "{").replace("}}", "}")  # a `str.format` template
    lua.write_text(headers + "\nfunction done" + done)
    assert story.cp is not None
    pid = story.cp.popen.pid
    before = _cpu_s(pid)
    result: WrkResult = run_wrk(url, lua, 4, seconds)
    cpu = _cpu_s(pid) - before
    return {"rps": result.rps, "p50_ms": result.p50_ms, "p99_ms": result.p99_ms, "requests": result.requests,
            "errors": result.non_2xx + result.socket_errors, "cpu_ms": cpu / max(1, result.requests) * 1000,
            "seconds": seconds}  # fmt: skip


def rounds(count: int, poll_s: int = 0) -> list[dict[str, Any]]:
    results = []
    poll = None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = build_demo_repository(root / "models")
        with Story(root, port=free_port(), agent_port=free_port()) as story:
            story.prepare()
            story.start_control_plane()
            # The same rule as the demo's, with room for every round to fire and recover (the flap limit would
            # otherwise latch it on the fifth within an hour, as it should).
            hysteresis = {**RULE["hysteresis"], "max_flaps_per_hour": 1000}  # type: ignore[dict-item]
            agent = story.enrol_and_add_rule({**RULE, "hysteresis": hysteresis})
            story.start_agent(models, agent, story.agent_token)
            for _ in range(count):
                asyncio.run(story.ramp([Phase("calm", 1, 3)]))
                reaction, surge = asyncio.run(_until(story, 32, "2", 20))
                recovery, _ = asyncio.run(_until(story, 1, "1", 30))
                refused = sum(1 for s in surge.samples if s.status != 200)
                results.append({"reaction_s": reaction, "recovery_s": recovery, "surge_answers": len(surge.samples),
                                "surge_refused": refused})  # fmt: skip
            events = [e["kind"] for e in story.events() if e["actor"] == "control-loop"]
            if poll_s:
                poll = poll_cost(story, root, poll_s)
    results.append({"events": events, "poll": poll})
    return results


def report(results: list[dict[str, Any]], evaluator: dict[str, Any] | None, command: str) -> str:
    events, poll = results[-1]["events"], results[-1]["poll"]
    rows = results[:-1]
    target = 2 * (INTERVAL_S + INTERVAL_S + 0)
    lines = [
        f"Command: `{command}`; export and poll intervals {INTERVAL_S:g} s, control loop every {INTERVAL_S / 2:g} s; "
        f"rule `{RULE['name']}` (queue depth > {RULE['condition']['threshold']} -> switch to version 2, `for` 0 s, "
        "`recover_after` 8 s).",
        "",
        "| round | reaction (breach -> lite answers) | recovery (calm -> version 1 answers) | surge answers | "
        "surge refused (503) |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, r in enumerate(rows, 1):
        reaction = "not within 20 s" if r["reaction_s"] is None else f"{r['reaction_s']:.2f} s"
        recovery = "not within 30 s" if r["recovery_s"] is None else f"{r['recovery_s']:.2f} s"
        lines.append(f"| {i} | {reaction} | {recovery} | {r['surge_answers']} | {r['surge_refused']} |")
    reactions = [r["reaction_s"] for r in rows if r["reaction_s"] is not None]
    recoveries = [r["recovery_s"] for r in rows if r["recovery_s"] is not None]
    if reactions:
        verdict = "met" if max(reactions) <= target else "missed"
        lines += ["", f"Reaction median {median(reactions):.2f} s, max {max(reactions):.2f} s; target "
                  f"<= {target:g} s: **{verdict}**. Recovery median "
                  f"{median(recoveries):.2f} s (includes `recover_after` "
                  f"8 s). Events: {', '.join(events)}."]  # fmt: skip
    if poll is not None:
        lines += [
            "",
            f"Policy poll, the 304 path (the agent's token, `If-None-Match` with the current ETag; wrk -t1 -c4, "
            f"{poll['seconds']} s, against the same control plane, its agent idle): {poll['rps']:.0f} polls/s, p50 "
            f"{poll['p50_ms']:.1f} ms, p99 {poll['p99_ms']:.1f} ms, {poll['errors']} errors; the control plane's "
            f"CPU {poll['cpu_ms']:.2f} ms per poll (1,000 agents polling every 5 s: 200 polls/s, "
            f"{200 * poll['cpu_ms'] / 10:.0f} % of one core).",
        ]  # fmt: skip
    if evaluator is not None:
        median_ok, worst_ok = evaluator["median_s"] < 1, evaluator["max_s"] < 2
        lines += [
            "",
            "Control-loop cycle for 1,000 agents x 10 rules x 5 SLOs (SQLite, bench/slo_eval.py's data, 30 minutes "
            f"of rollups, {evaluator['cycles']} cycles, one of them a fleet-wide firing): median "
            f"**{evaluator['median_s'] * 1000:.0f} ms**, worst **{evaluator['max_s'] * 1000:.0f} ms**; the fleet-wide "
            f"firing {evaluator['firing_s'] * 1000:.0f} ms ({evaluator['firing_transitions']:,} rule events, "
            f"{evaluator['firing_published']:,} documents published); first (cold) cycle {evaluator['cold_s']:.2f} s; "
            f"{evaluator['pairs']} (rule, agent) and (SLO, agent) pairs. Targets (issue 18): median < 1 s "
            f"**{'met' if median_ok else 'missed'}**, worst < 2 s **{'met' if worst_ok else 'missed'}**.",
        ]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--skip-evaluator", action="store_true")
    parser.add_argument("--poll-seconds", type=int, default=8, help="time the policy poll's 304 path (0: skip)")
    parser.add_argument("--write", action="store_true", help="put the table into docs/benchmarks.md")
    args = parser.parse_args()
    command = " ".join([".venv/bin/python", "bench/reaction.py", *sys.argv[1:]])
    results = rounds(args.rounds, args.poll_seconds)
    evaluator = None
    if not args.skip_evaluator:
        with tempfile.TemporaryDirectory() as tmp:
            evaluator = evaluator_run(f"sqlite:///{Path(tmp) / 'loop.db'}", agents=args.agents, slos=5,
                                      history_min=30, cycles=10, rules=10)  # fmt: skip
    text = report(results, evaluator, command)
    print(text)
    if args.write:
        block = f"{MARK_BEGIN}\n## Control loop: reaction and cycle cost (`bench/reaction.py`)\n\n{text}\n{MARK_END}"
        write_docs(block, MARK_BEGIN, MARK_END)


if __name__ == "__main__":
    main()
