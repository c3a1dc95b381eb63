"""The control loop end to end, with real processes on loopback: a control plane, an agent on the demo models,
and a load ramp. The rule fires under the surge, the agent switches `mlp` to its lite variant (answers say
version 2), the queue clears when the surge ends, and after `recover_after` the agent is back on version 1;
the events tell the story in order. Then the control plane dies: the agent keeps its policy, and a restarted
agent comes back with it from its disk cache."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx

from spillway.demo.models import build_demo_repository
from spillway.demo.story import Phase, Story, stop
from tests.utils.server import free_port


def _kinds(story: Story) -> list[str]:
    """What the control loop said about this agent, oldest first."""
    return [e["kind"] for e in story.events() if e.get("agent_id") == story.agent_id and e["actor"] == "control-loop"]


def test_a_rule_fires_under_load_the_agent_degrades_and_recovers(tmp_path: Path) -> None:
    models = build_demo_repository(tmp_path / "models")
    with Story(tmp_path, port=free_port(), agent_port=free_port()) as story:
        story.prepare()
        story.start_control_plane()
        agent = story.enrol_and_add_rule()
        story.start_agent(models, agent, story.agent_token)

        # The surge lasts until the lite variant answers (at most 40 s): how soon the rule fires depends on how busy
        # the machine is, which a fixed phase length would make a flake.
        calm, surge, after = asyncio.run(story.ramp([Phase("calm", 1, 2), Phase("surge", 32, 40, until="2"),
                                                     Phase("calm again", 1, 14)]))  # fmt: skip
        every = calm.samples + surge.samples + after.samples
        # Every request got an answer: served, or refused at admission (503) when its deadline could not be met.
        assert every and {s.status for s in every} <= {200, 503}, story.agent_log.read_text()[-3000:]
        assert set(calm.versions()) == {"1"}
        assert surge.versions()["2"] > 0, (surge.versions(), _kinds(story))  # degraded to the lite variant
        assert after.samples[-1].version == "1", (after.versions(), _kinds(story))  # and back
        kinds = _kinds(story)
        assert kinds[:4] == ["rule.fired", "policy.published", "rule.recovered", "policy.published"], kinds
        fired = next(e for e in story.events() if e["kind"] == "rule.fired")
        assert fired["data"]["observed"]["value"] > 12 and fired["data"]["action"] == {"kind": "switch_variant",
                                                                                       "version": 2}  # fmt: skip

        # Degrade again, then lose the control plane: the agent keeps serving with the policy it has.
        (surge2,) = asyncio.run(story.ramp([Phase("surge", 32, 40, until="2")]))
        assert surge2.versions()["2"] > 0
        status = story.agent_status()
        version = status["policy"]["version"]
        assert status["models"]["mlp"]["served_version"] == 2 and status["policy"]["source"] == "control_plane"
        stop(story.cp, signal.SIGKILL)
        (dark,) = asyncio.run(story.ramp([Phase("control plane down", 1, 3)]))
        assert {s.status for s in dark.samples} == {200} and set(dark.versions()) == {"2"}

        # Restart the agent with the control plane still down: it comes back with the same policy, from disk.
        stop(story.agent)
        story.start_agent(models, agent, story.agent_token)
        status = story.agent_status()
        assert (status["policy"]["version"], status["policy"]["source"]) == (version, "cache")
        assert status["models"]["mlp"]["served_version"] == 2
        answer = httpx.post(f"{story.agent_base}/v2/models/mlp/infer", timeout=10, json={
            "inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": [0.5] * 512}]})  # fmt: skip
        assert answer.status_code == 200 and answer.json()["model_version"] == "2"
