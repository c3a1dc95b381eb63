"""`spillway demo`: the story so far, on one machine.

1. a control plane on SQLite, an admin key, and the example fleet seeded through the REST API;
2. an edge agent serving the demo models (built from code) as the seeded agent `jetson-berlin-01`, exporting
   its OpenTelemetry metrics to the control plane with that agent's token;
3. a burst of mixed-priority traffic, with outcomes and latency per priority as the clients saw them;
4. the same burst as the control plane saw it through the agent's telemetry: per-priority latency, and each
   SLO's SLI, error budget and burn rates;
5. the control loop: a rule fires under a surge, the agent switches variant, and recovers;
6. overflow: a second, small edge agent under normal load, a 3x burst overflowing to a cloud backend through the
   control plane's gateway, the cloud killed mid-burst and the fallback chain answering, the cloud back;
7. generative traffic through the whole system: streaming chat clients (the `openai` package) at three priorities
   against a third edge agent serving tiny-lm, a TTFT SLO that burns, a rule that caps max_tokens and a harsher one
   that overflows priority 3 to a cloud agent behind the gateway (an `openai` backend), the cloud killed and back.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import yaml

EXAMPLE_FLEET = Path(__file__).resolve().parents[2] / "examples" / "fleet.yaml"
SEED_ORDER = ("agents", "slos", "rules", "backends")
# What the demo seeds from the example fleet: its backends are left out (the file's `cloud-triton-eu` is an example of
# the shape, with nothing behind it); the demo's backends are the real cloud agents its overflow acts start.
DEMO_SEEDS = ("agents", "slos", "rules")


def _say(line: str = "") -> None:
    print(line, flush=True)


def seed(
    client: httpx.Client, fleet: dict[str, Any], kinds: tuple[str, ...] = SEED_ORDER
) -> dict[str, list[dict[str, Any]]]:
    """POST every example resource of `kinds`; returns what the API answered, per kind."""
    created: dict[str, list[dict[str, Any]]] = {}
    for kind in kinds:
        for item in fleet.get(kind, []):
            response = client.post(f"/api/v1/{kind}", json=item)
            if response.status_code != 201:
                raise RuntimeError(
                    f"seeding {kind} '{item.get('name')}' failed: {response.status_code} {response.text}"
                )
            created.setdefault(kind, []).append(response.json())
    return created


DEMO_AGENT = "jetson-berlin-01"  # the seeded agent the local agent plays
EXPORT_INTERVAL_S = 1.0


class DemoStopped(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM: the demo stops wherever it is, its load and its processes with it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.at = time.monotonic()

    @property
    def reason(self) -> str:
        return "Ctrl-C" if self.signum == signal.SIGINT else signal.Signals(self.signum).name


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise `DemoStopped` in the main thread; once one has, both are ignored, so that a second
    Ctrl-C cannot cut the shutdown short and leave processes behind. The previous handlers come back at the end."""

    def stopped(signum: int, frame: FrameType | None) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise DemoStopped(signum)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, stopped)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_demo(*, port: int, agent_port: int, data_dir: str, once: bool, dashboard_port: int = 0) -> int:
    """The demo; on SIGINT or SIGTERM, wherever it is, the load stops, every process of the demo gets SIGTERM (and
    SIGKILL after `STOP_GRACE_S`), and a last line says so and how long that took."""
    try:
        with stop_on_signals():
            return _run_demo(port=port, agent_port=agent_port, data_dir=data_dir, once=once,
                             dashboard_port=dashboard_port)  # fmt: skip
    except DemoStopped as stop:  # the story's processes are stopped by now (Story.__exit__)
        _say()
        _say(f"demo stopped ({stop.reason}): control plane, agents and dashboard shut down in "
             f"{time.monotonic() - stop.at:.1f} s")  # fmt: skip
        return 128 + stop.signum  # the shell's convention: 130 after Ctrl-C, 143 after SIGTERM


def _run_demo(*, port: int, agent_port: int, data_dir: str, once: bool, dashboard_port: int) -> int:
    from spillway.demo.burst import DEFAULT_MIX, format_report, run_burst
    from spillway.demo.models import DEMO_VERSIONS, build_demo_repository
    from spillway.demo.progress import Steps, waiting
    from spillway.demo.story import RULE, Story

    root = Path(data_dir).resolve()
    with Story(root, port=port, agent_port=agent_port, interval_s=EXPORT_INTERVAL_S) as story:
        admin_key = story.prepare()
        base, agent_base = story.base, story.agent_base
        with Steps(f"building the demo models in {root / 'models'}", total=DEMO_VERSIONS) as steps:
            models = build_demo_repository(root / "models", progress=lambda line: steps.done(f"built {line}"))
        try:
            story.start_control_plane()
            with story.api() as client:
                created = seed(client, yaml.safe_load(EXAMPLE_FLEET.read_text()), DEMO_SEEDS)
                fleet_status = client.get("/api/v1/status").json()
            _report_control_plane(base, admin_key, created, fleet_status, story.cp_log)
            enrolled = next(a for a in created["agents"] if a["agent"]["name"] == DEMO_AGENT)
            story.agent_id, story.agent_token = enrolled["agent"]["id"], enrolled["token"]
            story.start_agent(models, enrolled["agent"], enrolled["token"])
            dashboard = _start_dashboard(story, admin_key, dashboard_port)
        except (RuntimeError, httpx.HTTPError) as exc:
            _say(f"error: {exc}")
            return 1
        if dashboard is not None:
            _say(
                f"Dashboard: http://127.0.0.1:{dashboard_port}  (log: {root / 'dashboard.log'}; watch the story there)"
            )
        _say(f"Edge agent: {agent_base}  (models: {models}, log: {story.agent_log})")
        _say(f"  it plays {DEMO_AGENT}: metrics every {EXPORT_INTERVAL_S:.0f} s to {base}/v1/metrics with its token,")
        _say(f"  policy polled every {EXPORT_INTERVAL_S:.0f} s from {base}/api/v1/agents/{story.agent_id}/policy")
        _say()
        _say("A burst of 1000 requests to mlp v1 from 48 concurrent clients, mixed priorities, as the clients saw it:")
        reports = asyncio.run(run_burst(agent_base, model="mlp", version="1", requests=1000, concurrency=48))
        _say(format_report(reports, DEFAULT_MIX))
        _say()
        with story.api() as client:
            agent_id = story.agent_id
            with waiting("the control plane to count the burst from the agent's telemetry"):
                seen = _wait_for_telemetry(client, agent_id, expected=sum(r.sent for r in reports.values()))
            _say("The same burst as the control plane saw it, from the agent's OpenTelemetry metrics (latency measured")
            _say("inside the agent, so below what the clients saw; percentiles interpolated within histogram buckets):")
            _say(format_telemetry(seen))
            _say()
            time.sleep(EXPORT_INTERVAL_S * 1.5)  # SLO figures are at most one evaluation interval old: wait one
            _say("SLOs now (from the same telemetry):")
            for slo in created.get("slos", []):
                _say(format_slo(client.get(f"/api/v1/slos/{slo['id']}/status").json()))
        _say()
        control_loop_story(story, RULE)
        _say()
        try:
            overflow_story(story)
        except (RuntimeError, httpx.HTTPError) as exc:
            _say(f"error: the overflow story failed: {exc}")
            return 1
        _say()
        try:
            generative_overflow_story(story)
        except (RuntimeError, httpx.HTTPError) as exc:
            _say(f"error: the generative overflow story failed: {exc}")
            return 1
        _say()
        _say(f"  curl {agent_base}/v2/spillway/status")
        _say(f'  curl -H "Authorization: Bearer $SPILLWAY_API_KEY" {base}/api/v1/agents/{agent_id}/metrics?window=5m')
        _say(f'  curl -H "Authorization: Bearer $SPILLWAY_API_KEY" {base}/api/v1/events')
        _say(f"  spillway agent burst --url {agent_base}")
        _say()
        if once:
            return 0
        _say("Serving until Ctrl-C (the dashboard, the control plane and the agents).")
        assert story.cp is not None
        return story.cp.wait()  # until the control plane ends, or a signal raises DemoStopped


def generative_overflow_story(story: Any) -> None:
    """Streams through the whole system (spillway/demo/generative_overflow_story.py): a TTFT SLO burns, a rule caps
    max_tokens, a harsher one overflows priority 3 to a cloud agent behind the gateway; the cloud dies and comes
    back. A table of the clients' streams per phase, the control loop's and the gateway's events, the counts."""
    from spillway.demo import generative_overflow_story as gen
    from spillway.demo.harness import free_port
    from spillway.demo.progress import waiting

    models = gen.lm_repository(story.root / "models-genai")
    act = gen.GenerativeOverflowStory(story, models=models, edge_port=free_port(), cloud_port=free_port())
    with waiting(f"the generative act's edge agent and cloud ({gen.MODEL}) to be ready, the cloud behind the gateway"):
        act.start()
    unloaded, duration, threshold = act.calibrate()
    threshold_ms = round(threshold * 1000, 6)
    _say(
        f"Generative overflow: an edge agent ({act.edge_url}, {gen.EDGE_NAME}) serves {gen.MODEL} with at most "
        f"{gen.EDGE_SEQS} streams at once;"
    )
    _say(f"a Spillway agent in cloud role ({act.cloud.url}, {gen.CLOUD_SEQS} at once) sits behind the control plane's "
         "gateway as an openai backend.")  # fmt: skip
    _say(f"Measured now: first token {unloaded * 1000:.0f} ms unloaded, a stream of {gen.MAX_TOKENS} tokens "
         f"{duration * 1000:.0f} ms with the engine full.")  # fmt: skip
    _say(f"SLO {gen.SLO_NAME}: {gen.OBJECTIVE:g} % of streams start within {threshold_ms:g} ms. Rules: burn >= "
         f"{gen.CAP_BURN:g}x caps max_tokens at {gen.CAP}; burn >= {gen.OVERFLOW_BURN:g}x for {gen.OVERFLOW_FOR} "
         "overflows priority 3 to the cloud.")  # fmt: skip
    act.add_policy(threshold_ms)
    _say("Closed-loop streaming chat clients (the openai package, greedy, a few prompts each) at priorities 1-3:")

    def announce(index: int, phase: Any) -> None:
        clients = "/".join(str(phase.clients.get(p, 0)) for p in (1, 2, 3))
        _say(f"  phase {index + 1}: {phase.name}, clients P1/P2/P3 {clients}")

    phases = gen.standard_phases(act)
    act.run(phases, on_phase=announce)
    _say()
    _say("Streams per phase as the clients saw them (outcome: spillway-outcome; lost: no [DONE], no error event and")
    _say("no HTTP answer; capped: answered with spillway-max-tokens-cap; burn: the SLO's over its 2m/1m windows):")
    _say(gen.format_phases(phases))
    _say()
    _say("Events from the control loop and the gateway (GET /api/v1/events):")
    for event in act.events():
        _say(gen.describe_event(event))
    every = [*act.probes, *phases]
    ended = gen.endings(every)
    odd = "".join(f"; {k} {v}" for k, v in ended.items() if k not in ("[DONE]", "error event", "HTTP answer", "lost"))
    _say(f"Every stream ended once: {ended['[DONE]']} with [DONE], {ended['error event']} with an error event, "
         f"{ended['HTTP answer']} with an HTTP answer (refused before a token); lost {ended['lost']}{odd}")  # fmt: skip
    overflowed, marked = gen.overflow_marks(every, act.cloud.name)
    _say(f"Overflowed streams: {overflowed}, of which {marked} said so in the spillway-backend header and in a last "
         f"chunk naming the backend ({act.cloud.name}) before [DONE]")  # fmt: skip
    sent = gen.client_counts(every)
    counted = act.agent_counts(sum(sent.values()))
    words = ", ".join(f"{k} {v}" for k, v in sent.most_common())
    _say(f"The clients counted {sum(sent.values())} streams: {words}")
    if counted is None:
        _say("The control plane shows no generative telemetry for the edge agent.")
    else:
        words = ", ".join(f"{k} {v}" for k, v in counted.most_common())
        _say(f"The control plane counted {sum(counted.values())} from the edge agent's telemetry: {words}")


def _start_dashboard(story: Any, admin_key: str, port: int) -> Any:
    """The dashboard beside the story (stopped with it); None when `port` is 0."""
    if not port:
        return None
    from dashboards import start_dashboard, wait_ready
    from spillway.demo.harness import Process
    from spillway.demo.progress import waiting

    proc = start_dashboard(story.base, admin_key, port=port, log_path=story.root / "dashboard.log")
    story.track(Process(proc, name="the dashboard"))
    with waiting(f"the dashboard (http://127.0.0.1:{port})"):
        wait_ready(f"http://127.0.0.1:{port}", proc)
    return proc


def control_loop_story(story: Any, rule: dict[str, Any]) -> None:
    """A load ramp past the rule and back, one line a second, then the events the control loop wrote."""
    from spillway.demo.story import Phase

    condition = rule["condition"]
    _say(f"The control loop: rule '{rule['name']}' switches mlp to its lite variant (v2) while the queue is deeper "
         f"than {condition['threshold']}")  # fmt: skip
    _say(f"(recover_after {rule['hysteresis']['recover_after']}). A ramp: 3 s calm, 8 s surge of 32 clients, 14 s calm;"
         " requests name no version, the policy decides:")  # fmt: skip
    first_event = max((e["id"] for e in story.events()), default=0)
    story.add_rule(rule)
    phases = [Phase("calm", 1, 3), Phase("surge", 32, 8), Phase("calm", 1, 14)]
    shown = {"n": 0}

    def tick(at: float) -> None:
        samples = [s for p in phases for s in p.samples]
        recent = [s for s in samples if at - 1.0 <= s.at < at]
        versions = ", ".join(f"v{v} {n}" for v, n in sorted(Counter(s.version or f"HTTP {s.status}"
                                                                     for s in recent).items()))  # fmt: skip
        phase = next((p.name for p in phases if p.samples and p.samples[-1].at >= at - 1.0), "")
        try:
            status = story.agent_status()
            mlp = status["models"]["mlp"]
            agent = f"policy v{status['policy']['version']}, serving v{mlp['served_version']}"
        except (httpx.HTTPError, KeyError):
            agent = "agent status unavailable"
        shown["n"] += 1
        _say(f"  {at:5.1f} s  {phase:5}  answers/s: {versions or '-':24}  agent: {agent}")

    asyncio.run(story.ramp(phases, on_tick=tick))
    _say()
    _say("Events from the control loop (GET /api/v1/events):")
    for event in story.events(first_event):
        if event["actor"] != "control-loop":
            continue
        data = event.get("data") or {}
        detail = ""
        if event["kind"].startswith("rule."):
            observed = data.get("observed", {})
            detail = f"{data.get('rule')}: {observed.get('metric', '')} {observed.get('value', '')}"
        elif event["kind"] == "policy.published":
            detail = f"version {data.get('version')}, causes: {[c['name'] for c in data.get('causes', [])] or 'none'}"
        _say(f"  {event['ts'][11:19]}  {event['kind']:18} {detail}")


def overflow_story(story: Any) -> None:
    """The overflow story (spillway/demo/overflow_story.py) beside the running control plane: outcome mix per phase."""
    from spillway.demo.harness import free_port
    from spillway.demo.overflow_story import OverflowStory, format_phases, small_repository, standard_phases
    from spillway.demo.progress import waiting

    small = small_repository(story.root / "models-slow")
    overflow = OverflowStory(story, models=small, edge_port=free_port(), cloud_ports=[free_port()])
    with waiting("the overflow act's edge agent and cloud backend to be ready"):
        overflow.start()
    capacity = overflow.calibrate()
    _say(f"Overflow: a second edge agent ({overflow.edge_url}) serving a slow mlp (about 20 ms a request, one")
    _say(f"at a time, one thread) answers about {capacity:.0f} requests/s itself. A cloud backend of the same kind")
    _say(f"(a Spillway agent in cloud role, {overflow.clouds[0].url}) sits behind the control plane's gateway.")
    _say(
        f"Open-loop load, 20 % priority 1, each request with a {overflow.deadline_us // 1000} ms deadline (five service"
    )
    _say("times of this machine as measured now, 100 ms at least); what the device would not answer in time overflows,")
    _say("priority 2 first:")

    def announce(index: int, phase: Any) -> None:
        _say(f"  phase {index + 1}: {phase.name}, {phase.rate:.0f} requests/s for {phase.seconds:.0f} s")

    phases = overflow.run(standard_phases(capacity, overflow), on_phase=announce)
    _say()
    _say("Outcomes per phase (spillway-outcome of each answer; lost = sent without an answer):")
    _say(format_phases(phases))
    seen = overflow.edge_outcomes()
    sent = sum(p.sent for p in phases)
    _say(f"The agent counted {sum(seen.values())} requests ({sent} sent by the story, plus its capacity probe): "
         + ", ".join(f"{k} {v}" for k, v in seen.most_common()))  # fmt: skip
    _say("Gateway backends (GET /api/v1/status):")
    for backend in overflow.gateway():
        _say(f"  {backend['name']:16} healthy={backend.get('healthy')} ejected={backend.get('ejected')} "
             f"requests={backend.get('requests')} errors={backend.get('errors')}")  # fmt: skip


def _wait_for_telemetry(client: httpx.Client, agent_id: str, expected: int, deadline_s: float = 20.0) -> Any:
    """The agent's metrics once the control plane has counted every request of the burst (or the deadline)."""
    deadline = time.monotonic() + deadline_s
    while True:
        seen = client.get(f"/api/v1/agents/{agent_id}/metrics", params={"window": "5m"}).json()
        if seen.get("requests", 0) >= expected or time.monotonic() > deadline:
            return seen
        time.sleep(EXPORT_INTERVAL_S / 2)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_telemetry(seen: dict[str, Any]) -> str:
    lines = [
        "| model | priority | requests | outcomes | p50 ms | p95 ms | p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in seen.get("traffic", []):
        outcomes = ", ".join(f"{name} {count:.0f}" for name, count in sorted(row["outcomes"].items(),
                                                                           key=lambda kv: -kv[1]))  # fmt: skip
        latency = row["latency_ms"]
        lines.append(f"| {row['model']} | {row['priority']} | {row['requests']:.0f} | {outcomes} | "
                     f"{_ms(latency['p50'])} | {_ms(latency['p95'])} | {_ms(latency['p99'])} |")  # fmt: skip
    lines.append(f"counted by the control plane: {seen.get('requests', 0):.0f} requests")
    return "\n".join(lines)


def format_slo(status: dict[str, Any]) -> str:
    sli = "no traffic" if status["sli"] is None else f"SLI {status['sli'] * 100:.2f} %"
    budget = status["budget_remaining"]
    left = "-" if budget is None else f"{budget * 100:.0f} %"
    objective = f"objective {status['objective']:g} % over {status['window']}"
    line = f"  {status['name']}: {sli} ({objective}), budget left {left}"
    for alert in status["alerts"]:
        rates = [("-" if r is None else f"{r:.1f}x") for r in (alert["long_burn_rate"], alert["short_burn_rate"])]
        state = "FIRING" if alert["firing"] else "ok"
        long, short = _span(alert["long"]), _span(alert["short"])
        line += (f"\n    burn rate over {long}: {rates[0]}, over {short}: {rates[1]} "
                 f"(fires at {alert['threshold']:g}x, {alert['severity']}): {state}")  # fmt: skip
    return line


def _span(duration: str) -> str:
    """'336m' -> '5.6h': the scaled alert windows read better in hours."""
    if duration.endswith("m") and int(duration[:-1]) >= 120:
        return f"{int(duration[:-1]) / 60:g}h"
    return duration


def _report_control_plane(
    base: str, key: str, created: dict[str, list[dict[str, Any]]], status: dict[str, Any], log: Path
) -> None:
    _say()
    _say(f"Spillway control plane: {base}   (log: {log})")
    _say(f"Admin API key (shown once): {key}")
    _say()
    for kind in DEMO_SEEDS:
        items = created.get(kind, [])
        names = ", ".join((i.get("agent", i))["name"] for i in items)
        _say(f"  seeded {len(items)} {kind}: {names}")
    _say("  backends: none seeded; the overflow acts below start real ones (Spillway agents in cloud role) and")
    _say("  register them as they come up")
    for item in created.get("agents", []):
        _say(f"  agent token for {item['agent']['name']} (shown once): {item['token']}")
    _say()
    _say(
        f"Fleet status: {status['agents']['total']} agents, {status['slos']} SLOs, "
        f"{status['rules']} rules ({status['rules_enabled']} enabled), {status['backends']} backends"
    )
    _say()
    _say("Where to look:")
    _say(f"  export SPILLWAY_API_KEY={key}")
    for path in ("status", "slos", "rules", "events", "openapi.json"):
        _say(f'  curl -H "Authorization: Bearer $SPILLWAY_API_KEY" {base}/api/v1/{path}')
    _say()
