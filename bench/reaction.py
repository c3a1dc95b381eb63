"""How fast the control loop reacts: breach onset -> policy applied at the agent, and recovery, with real
processes on loopback (spillway/demo/story.py: a control plane, an agent on the demo models, the rule
`lite-when-queue-deep`); and what one control-loop cycle costs for 1,000 agents x 10 rules (bench/slo_eval.py).

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
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import free_port, median, write_docs
from bench.slo_eval import run as evaluator_run
from spillway.demo.models import build_demo_repository
from spillway.demo.story import INTERVAL_S, RULE, Phase, Story

MARK_BEGIN, MARK_END = "<!-- bench/reaction.py: begin -->", "<!-- bench/reaction.py: end -->"


async def _until(story: Story, clients: int, want: str, limit_s: float) -> tuple[float | None, Phase]:
    """Run `clients` until an answer comes from version `want`; seconds from the phase's start, or None."""
    (phase,) = await story.ramp([Phase(f"until v{want}", clients, limit_s, until=want)])
    return next((s.at for s in phase.samples if s.version == want), None), phase  # `at`: from the phase's start


def rounds(count: int) -> list[dict[str, Any]]:
    results = []
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
    results.append({"events": events})
    return results


def report(results: list[dict[str, Any]], evaluator: dict[str, Any] | None, command: str) -> str:
    events = results[-1]["events"]
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
    if evaluator is not None:
        lines += [
            "",
            "Control-loop cycle for 1,000 agents x 10 rules x 5 SLOs (SQLite, bench/slo_eval.py's data, 30 minutes "
            f"of rollups, {evaluator['cycles']} cycles): median **{evaluator['median_s'] * 1000:.0f} ms**, p99 "
            f"{evaluator['p99_s'] * 1000:.0f} ms, first (cold) cycle {evaluator['cold_s']:.2f} s, "
            f"{evaluator['pairs']} (rule, agent) and (SLO, agent) pairs; target <= 1 s: "
            f"**{'met' if evaluator['median_s'] <= 1 else 'missed'}**.",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--skip-evaluator", action="store_true")
    parser.add_argument("--write", action="store_true", help="put the table into docs/benchmarks.md")
    args = parser.parse_args()
    command = " ".join([".venv/bin/python", "bench/reaction.py", *sys.argv[1:]])
    results = rounds(args.rounds)
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
