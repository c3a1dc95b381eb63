"""`spillway slo` against a real control plane on loopback: import -> export -> import unchanged, the Prometheus
rules, and one clear line (no traceback) for each way it can fail."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from typer.testing import CliRunner, Result

from controlplane.app import create_app
from controlplane.schemas.slos import SloCreate
from controlplane.settings import Settings
from controlplane.slo import openslo
from spillway.cli import app
from tests.conftest import make_keys
from tests.utils.builders import make_slo
from tests.utils.server import free_port, serving


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    url = f"sqlite:///{tmp_path_factory.mktemp('slo-cli') / 'spillway.db'}"
    keys = make_keys(url)
    with serving(create_app(Settings(database_url=url, control_loop_interval_s=0))) as base:
        yield base, keys


def slo(plane: tuple[str, dict[str, str]], *args: str, key: str | None = "editor") -> Result:
    base, keys = plane
    env = {"SPILLWAY_API": base, "SPILLWAY_API_KEY": keys[key] if key else ""}
    return CliRunner().invoke(app, ["slo", *args], env=env)


def _one_line_error(result: Result, code: int, *words: str) -> None:
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert all(w in lines[0] for w in words), lines[0]


def test_import_export_import_is_unchanged(plane: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    source = tmp_path / "slos.yaml"
    slos = [SloCreate.model_validate(make_slo(name="cli_latency", selector={"model": "mlp", "tenant": "acme"})),
            SloCreate.model_validate(make_slo(name="cli-up", sli_kind="availability", threshold_ms=None))]  # fmt: skip
    source.write_text(openslo.dump_all(slos))

    dry = slo(plane, "import", str(source), "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert [line.split("\t")[:2] for line in dry.stdout.splitlines()] == [["would create", "cli_latency"],
                                                                          ["would create", "cli-up"]]  # fmt: skip
    first = slo(plane, "import", str(source))
    assert first.exit_code == 0 and first.stdout.count("created\t") == 2, first.output
    ident = first.stdout.splitlines()[0].split("\t")[2]

    exported = tmp_path / "out.yaml"
    by_name = slo(plane, "export", "cli_latency", "-o", str(exported), key="viewer")
    assert by_name.exit_code == 0, by_name.output
    assert openslo.parse(exported.read_text())[0].slo == slos[0]
    by_id = slo(plane, "export", ident, key="viewer")
    assert by_id.exit_code == 0 and by_id.stdout == exported.read_text()
    everything = slo(plane, "export", "--all", key="viewer")
    assert {d["metadata"]["name"] for d in yaml.safe_load_all(everything.stdout)} >= {"cli-latency", "cli-up"}

    again = slo(plane, "import", str(exported))
    assert again.exit_code == 0 and again.stdout.startswith(f"unchanged\tcli_latency\t{ident}"), again.output

    rules = slo(plane, "rules", "cli-up", key="viewer")
    assert rules.exit_code == 0, rules.output
    assert "groups" in yaml.safe_load(rules.stdout)


def test_failures_are_one_clear_line(plane: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    _one_line_error(slo(plane, "export", "--all", key=None), 2, "SPILLWAY_API_KEY")
    _one_line_error(slo(plane, "import", str(tmp_path / "missing.yaml")), 1, "cannot read", "missing.yaml")
    not_yaml = tmp_path / "bad.yaml"
    not_yaml.write_text("spec: [unclosed\n")
    _one_line_error(slo(plane, "import", str(not_yaml)), 1, "not YAML")
    calendar = tmp_path / "calendar.yaml"
    calendar.write_text(
        openslo.dump(SloCreate.model_validate(make_slo(name="cli-cal"))).replace("isRolling: true", "isRolling: false")
    )
    _one_line_error(slo(plane, "import", str(calendar)), 1, "HTTP 422", "documents[0].spec.timeWindow[0].isRolling")
    _one_line_error(slo(plane, "import", str(calendar), key="viewer"), 1, "HTTP 403", "editor")
    _one_line_error(slo(plane, "export", "no-such-slo"), 1, "no SLO", "no-such-slo")
    _one_line_error(slo(plane, "export"), 2, "--all")
    base, keys = plane
    bad_key = CliRunner().invoke(app, ["slo", "export", "--all"], env={"SPILLWAY_API": base,
                                                                        "SPILLWAY_API_KEY": "spk_x_y"})  # fmt: skip
    _one_line_error(bad_key, 1, "HTTP 401")
    nobody = f"http://127.0.0.1:{free_port()}"
    down = CliRunner().invoke(app, ["slo", "export", "--all", "--api", nobody], env={"SPILLWAY_API_KEY": keys["admin"]})
    _one_line_error(down, 1, "cannot reach the control plane", nobody)
    assert httpx.get(f"{base}/readyz").status_code == 200  # the plane was up all along: only the URL was wrong


@pytest.mark.parametrize("key", ["spk_SECRET\rX", "spk_SECRET\x01X", "spk_SECRÉTX", "spk_SECRET\nX"])
def test_a_key_that_cannot_be_a_header_is_refused_without_showing_it(plane: tuple[str, dict[str, str]],
                                                                     key: str) -> None:  # fmt: skip
    base, _ = plane
    for args in (["export", "--all"], ["rules"], ["export", "some-slo"]):
        result = CliRunner().invoke(app, ["slo", *args], env={"SPILLWAY_API": base, "SPILLWAY_API_KEY": key})
        _one_line_error(result, 2, "SPILLWAY_API_KEY", "printable ASCII")
        assert "SECRET" not in result.output and "SECRÉT" not in result.output, result.output


def test_slos_named_like_routes_are_found_by_name(plane: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    names = ["openslo", "prometheus-rules", "import"]
    source = tmp_path / "routes.yaml"
    source.write_text(openslo.dump_all([SloCreate.model_validate(make_slo(name=n)) for n in names]))
    assert slo(plane, "import", str(source)).exit_code == 0
    for name in names:
        exported = slo(plane, "export", name, key="viewer")
        assert exported.exit_code == 0, exported.output
        assert [i.slo.name for i in openslo.parse(exported.stdout)] == [name]
        rules = slo(plane, "rules", name, key="viewer")
        assert rules.exit_code == 0, rules.output
        assert [g["name"] for g in yaml.safe_load(rules.stdout)["groups"]] == [f"spillway-slo-{name}"]


def test_a_deep_file_and_an_answer_that_is_not_json_are_one_line(plane: tuple[str, dict[str, str]],
                                                                   tmp_path: Path) -> None:  # fmt: skip
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 5000)
    _one_line_error(slo(plane, "import", str(deep)), 1, "HTTP 422", "body", "not YAML")

    other = FastAPI()

    @other.api_route("/{path:path}", methods=["GET", "POST"])
    def anything(path: str) -> PlainTextResponse:
        return PlainTextResponse(f"hello from {path}")

    _, keys = plane
    source = tmp_path / "one.yaml"
    source.write_text(openslo.dump(SloCreate.model_validate(make_slo(name="cli-not-json"))))
    with serving(other) as elsewhere:
        env = {"SPILLWAY_API": elsewhere, "SPILLWAY_API_KEY": keys["editor"]}
        for args in (["import", str(source)], ["export", "cli-not-json"], ["rules", "cli-not-json"]):
            result = CliRunner().invoke(app, ["slo", *args], env=env)
            _one_line_error(result, 1, "not JSON", "the control plane?")
