"""SLOs as OpenSLO v1 YAML and back: `dump` writes an SLO as one `SLO` document, `parse` reads one or more documents
into `SloCreate`s, refusing with the field's path (`documents[1].spec.timeWindow[0].isRolling`) what Spillway cannot
store. Pure conversion: no database, no web.

How an SLO maps (an export imports back to the identical SLO):

- `name` -> `metadata.name` when it is an RFC 1123 label (lowercase letters, digits, '-', at most 63), else a label
  made from it plus the exact name in the annotation `spillway.dev/name`; in an export of several SLOs a label already
  taken (`My_SLO` and `my-slo`) gets a suffix from the SLO's id. Import takes the annotation while `metadata.name` is
  still the label made from it, else (the file was edited) `metadata.name`.
- `description` -> `spec.description` (at most 1050 characters there: a longer one is cut there and kept whole in
  `spillway.dev/description`, which import takes while `spec.description` is still that cut); import takes
  `spec.description`, else `metadata.displayName`, else "".
- `sli_kind`, `selector` and `threshold_ms` -> an inline SLI whose `ratioMetric` (`counter: true`) has good and total
  `metricSource`s of `type: Prometheus` with `spec.query` = the series selectors of `controlplane.slo.promql`.
  Import recognises exactly those forms (the metric names, `spillway_outcome`, `le`, the model and tenant labels and
  the agents' labels), rebuilds the SLO (the threshold whose `le` text is the one written: 4.2 ms is
  le="0.004200000000000001") and regenerates the queries to compare; an agent label whose key is not a
  Prometheus label name (`topology.kubernetes.io/zone`) is named back in the SLI's `spillway.dev/label-keys`
  annotation (`prom_name=key,...`).
- `objective` (percent) -> `objectives[0].target` (a ratio: 99.5 -> 0.995, shifted in decimal so no float noise
  appears either way); import also takes `targetPercent`.
- `window` -> `timeWindow: [{duration, isRolling: true}]` in whole minutes, hours or days; `budgetingMethod:
  Occurrences`. `service` is `spillway` (import ignores it).
- each `alert_windows` pair -> one inline `AlertPolicy` (OpenSLO allows one condition per policy) whose inline
  `AlertCondition` is `{kind: burnrate, op: gte, threshold: burn_rate, lookbackWindow: long}` with `severity`
  page|ticket. The short window has no OpenSLO field (`alertAfter` is a delay: the condition must hold that long,
  which Spillway does not do), so it travels in the condition's `spillway.dev/short-window` annotation; a burn-rate
  condition without it gets the SRE workbook's ratio, long / 12 in whole minutes, halves up (1h -> 5m, 30m -> 3m).
  `alertAfter` is accepted only when zero. The policy's notification target and `alertWhen*` flags are written with
  Spillway's behaviour (alerts when breaching, into its events and status) and ignored on import. No `alertPolicies`:
  no pairs.

Refused, with the field: another `apiVersion`, calendar windows (`calendar`, `isRolling: false`, `M`/`Q`/`Y`
durations), `Timeslices`/`RatioTimeslices`, `thresholdMetric`, `bad`/`raw` ratios, `counter: false`, a metric
source that is not Prometheus or a query Spillway does not generate, several objectives, composite objectives,
conditions that are not burn rates at or above a threshold (`op: gte`; Spillway fires at >=), numbers that are not
finite, severities other than page/ticket, references (`indicatorRef`, `alertPolicyRef`, `conditionRef`) to documents
not in the same file, names Spillway cannot store, and YAML with aliases or nested deeper than MAX_DEPTH. `SLI`,
`AlertPolicy` and `AlertCondition` documents are read when an SLO refers to them; `Service`, `DataSource` and
`AlertNotificationTarget` documents are accepted and ignored.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, NoReturn

import yaml
from pydantic import ValidationError

from controlplane.errors import Conflict, ValidationFailed
from controlplane.schemas.slos import SloCreate
from controlplane.slo import promql
from spillway.contract.tenants import DEFAULT_TENANT

API_VERSION = "openslo/v1"
ANNOTATION = "spillway.dev/"
NAME_ANNOTATION = f"{ANNOTATION}name"
DESCRIPTION_ANNOTATION = f"{ANNOTATION}description"
LABEL_KEYS_ANNOTATION = f"{ANNOTATION}label-keys"
SHORT_WINDOW_ANNOTATION = f"{ANNOTATION}short-window"
SERVICE = "spillway"
MAX_DESCRIPTION = 1050  # OpenSLO's limit on spec.description
KINDS = frozenset({"SLO", "SLI", "AlertPolicy", "AlertCondition", "AlertNotificationTarget", "DataSource", "Service"})

_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_SHORTHAND = re.compile(r"^([1-9][0-9]*)([mhdwMQY])$")
_SHORTHAND_SECONDS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SERIES = re.compile(r"^\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*\{(.*)\}\s*$", re.S)
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!=|!~|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)', re.S)
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


# ---- export ----------------------------------------------------------------------------------


def _shorthand(seconds: int, what: str, slo: str) -> str:
    """Seconds as an OpenSLO duration-shorthand: whole days, hours or minutes (it has no seconds)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    raise Conflict(
        f"SLO '{slo}': its {what} ({seconds}s) is not a whole number of minutes, which an OpenSLO duration cannot "
        "say; change it to whole minutes to export it",
        details=[{"field": what, "message": "not a whole number of minutes"}],
    )


def dns_label(name: str, suffix: str = "") -> str:
    """An RFC 1123 label (what every OpenSLO implementation must accept as a name) made from `name` + `suffix`."""
    base = re.sub(r"[^a-z0-9-]", "-", name.lower()).strip("-") or "slo"
    return f"{base[: 63 - len(suffix)].rstrip('-') or 'slo'}{suffix}"


def _cut(description: str) -> str:
    """A description as `spec.description` holds it (at most MAX_DESCRIPTION characters)."""
    return description if len(description) <= MAX_DESCRIPTION else description[: MAX_DESCRIPTION - 1] + "…"


def _derived_name(name: str, exact: str) -> bool:
    """Whether `metadata.name` is the label an export made from the exact name (see `unique_names`): not edited."""
    if name == dns_label(exact):
        return True
    return any(name == dns_label(exact, name[i:]) for i in range(len(name))
               if name[i] == "-" and re.fullmatch(r"-[a-z0-9]{8,}", name[i:]))  # fmt: skip


def _target(objective: float) -> float:
    """99.5 -> 0.995 by a decimal shift of the shortest text, so 99.9 gives 0.999 and not 0.9990000000000001."""
    return float(Decimal(repr(float(objective))).scaleb(-2))


def _objective(target: float) -> float:
    return float(Decimal(repr(float(target))).scaleb(2))


def document(slo: SloCreate, name: str | None = None) -> dict[str, Any]:
    """One OpenSLO v1 `SLO` document (inline SLI and alert policies) for an SLO, named `name` (default: the label
    made from its name).

    Raises:
        Conflict: what OpenSLO (or PromQL) cannot say: a window that is not whole minutes, agent labels that are not
            label matchers.
    """
    name = name or dns_label(slo.name)
    annotations: dict[str, str] = {}
    if name != slo.name:
        annotations[NAME_ANNOTATION] = slo.name
    description = slo.description
    if len(description) > MAX_DESCRIPTION:
        annotations[DESCRIPTION_ANNOTATION] = description
        description = _cut(description)
    selector = slo.selector.model_dump(exclude_none=True)
    try:
        query = promql.sli_query(slo.sli_kind, selector, slo.threshold_ms)
    except promql.UnexpressibleSelector as exc:
        raise Conflict(f"SLO '{slo.name}': {exc}", details=[{"field": "selector.labels", "message": str(exc)}]) from exc
    renamed = {promql.label_name(k): k for k in sorted(slo.selector.labels) if promql.label_name(k) != k}
    sli_meta: dict[str, Any] = {"name": dns_label(name, "-sli")}
    if renamed:
        sli_meta["annotations"] = {LABEL_KEYS_ANNOTATION: ",".join(f"{p}={k}" for p, k in renamed.items())}

    def source(series: str) -> dict[str, Any]:
        return {"metricSource": {"type": "Prometheus", "spec": {"query": series}}}

    spec: dict[str, Any] = {}
    if description:
        spec["description"] = description
    spec["service"] = SERVICE
    spec["indicator"] = {
        "metadata": sli_meta,
        "spec": {"ratioMetric": {"counter": True, "good": source(query.good), "total": source(query.total)}},
    }
    spec["timeWindow"] = [{"duration": _shorthand(slo.window, "window", slo.name), "isRolling": True}]
    spec["budgetingMethod"] = "Occurrences"
    spec["objectives"] = [{"displayName": f"{slo.objective:g} % good", "target": _target(slo.objective)}]
    policies = []
    for i, alert in enumerate(slo.alert_windows):
        long = _shorthand(alert.long, f"alert_windows.{i}.long", slo.name)
        short = _shorthand(alert.short, f"alert_windows.{i}.short", slo.name)
        policy = dns_label(name, f"-{long}-{short}".lower())
        condition = {
            "kind": "AlertCondition",
            "metadata": {"name": policy, "annotations": {SHORT_WINDOW_ANNOTATION: short}},
            "spec": {
                "description": f"burn rate at least {alert.burn_rate:g} over {long} and over {short}",
                "severity": alert.severity,
                "condition": {"kind": "burnrate", "op": "gte", "threshold": alert.burn_rate, "lookbackWindow": long},
            },
        }
        target = {"kind": "AlertNotificationTarget", "metadata": {"name": "spillway-events"},
                  "spec": {"target": "spillway", "description": "Spillway's SLO status and events"}}  # fmt: skip
        policies.append({
            "kind": "AlertPolicy",
            "metadata": {"name": policy},
            "spec": {"alertWhenNoData": False, "alertWhenResolved": False, "alertWhenBreaching": True,
                     "conditions": [condition], "notificationTargets": [target]},
        })  # fmt: skip
    if policies:
        spec["alertPolicies"] = policies
    metadata: dict[str, Any] = {"name": name}
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": API_VERSION, "kind": "SLO", "metadata": metadata, "spec": spec}


def dump(slo: SloCreate) -> str:
    """An SLO as OpenSLO v1 YAML (one document)."""
    return dump_all([slo])


def unique_names(slos: Sequence[SloCreate], ids: Sequence[str]) -> list[str]:
    """A distinct `metadata.name` for each SLO: its label, or for a later SLO whose label is taken (`My_SLO` and
    `my-slo` are both `my-slo`) the label with a suffix from its id (`my-slo-3f2a9c1e`); the exact name travels in
    the `spillway.dev/name` annotation either way."""
    names: list[str] = []
    used: set[str] = set()
    for slo, ident in zip(slos, ids, strict=True):
        names.append(next(n for n in _candidate_names(slo.name, ident) if n not in used))
        used.add(names[-1])
    return names


def _candidate_names(name: str, ident: str) -> Iterator[str]:
    yield dns_label(name)
    tail = re.sub(r"[^a-z0-9]", "", ident.lower())[:16].rjust(8, "0")
    for size in range(8, len(tail) + 1):
        yield dns_label(name, f"-{tail[:size]}")
    n = 2
    while True:  # the whole id is taken too (only with made-up ids)
        yield dns_label(name, f"-{tail}{n}")
        n += 1


def dump_all(slos: Sequence[SloCreate], ids: Sequence[str] | None = None) -> str:
    """SLOs as one multi-document OpenSLO v1 YAML (empty text for none), with distinct `metadata.name`s (made with
    the SLOs' `ids`, when given, where two names make the same label)."""
    names = unique_names(slos, ids if ids is not None else [str(i) for i in range(len(slos))])
    docs = [document(slo, name) for slo, name in zip(slos, names, strict=True)]
    return yaml.safe_dump_all(docs, sort_keys=False, allow_unicode=True, width=1_000_000) if docs else ""


# ---- import ----------------------------------------------------------------------------------


class _Refused(Exception):
    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


def _refuse(path: str, message: str) -> NoReturn:
    raise _Refused(path, message)


MAX_DEPTH = 64  # nested collections: an OpenSLO document needs about 12
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: many times faster


def _where(event: yaml.Event) -> str:
    mark = event.start_mark
    return "" if mark is None else f" (line {mark.line + 1}, column {mark.column + 1})"


def _check_events(text: str) -> None:
    """Refuse aliases (a few bytes of them can stand for billions of nodes) and nesting deeper than MAX_DEPTH (the
    composer recurses) by a pass over the parser's events, which keeps no tree and does not recurse."""
    depth = 0
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, yaml.AliasEvent):
            raise yaml.YAMLError(f"YAML aliases are not accepted{_where(event)}")
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise yaml.YAMLError(f"nested deeper than {MAX_DEPTH} levels{_where(event)}")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def load_documents(text: str) -> list[Any]:
    """The YAML documents of `text` (empty ones dropped), safe YAML without aliases; not YAML: 422 naming `body`."""
    try:
        _check_events(text)
        return [doc for doc in yaml.load_all(text, Loader=_LOADER) if doc is not None]  # a SafeLoader
    except (yaml.YAMLError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else " ".join(str(exc).split())
        raise ValidationFailed.field("body", f"not YAML: {why}") from exc


def _mapping(value: Any, path: str, required: bool = True) -> dict[str, Any]:
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        _refuse(path, "required" if value is None else "must be an object")
    return value


def _text(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        _refuse(path, "required" if value is None else "must be a non-empty string")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        _refuse(path, "required" if value is None else "must be a list")
    return value


def _number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        _refuse(path, "required" if value is None else "must be a number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        _refuse(path, "must be a finite number")
    return number


def _duration(value: Any, path: str) -> int:
    if not isinstance(value, str):
        _refuse(path, "required" if value is None else "must be a duration such as '5m', '1h', '28d'")
    match = _SHORTHAND.match(value)
    if match is None:
        _refuse(path, f"'{value}' is not an OpenSLO duration: a positive whole number and one of m, h, d, w")
    if match.group(2) in "MQY":
        _refuse(path, f"'{value}': months, quarters and years are calendar lengths; Spillway windows are rolling "
                "and fixed (use d or w)")  # fmt: skip
    return int(match.group(1)) * _SHORTHAND_SECONDS[match.group(2)]


def _annotations(metadata: Mapping[str, Any], path: str) -> dict[str, Any]:
    return _mapping(metadata.get("annotations"), f"{path}.annotations", required=False)


@dataclass(frozen=True)
class _Doc:
    index: int
    body: dict[str, Any]

    @property
    def path(self) -> str:
        return f"documents[{self.index}]"


def _series(query: Any, path: str) -> tuple[str, list[tuple[str, str, str]]]:
    """A PromQL series selector `metric{label="value", ...}` as its metric and matchers; anything else refused."""
    text = _text(query, path)
    match = _SERIES.match(text)
    if match is None:
        _refuse(path, "not a query Spillway generates: expected a series selector such as "
                "spillway_requests_total{...} (see GET /api/v1/slos/{id}/openslo)")  # fmt: skip
    body, found, pos = match.group(2), [], 0
    while body.strip() and pos < len(body):
        m = _MATCHER.match(body, pos)
        if m is None or m.end() == pos:
            _refuse(path, f"not a query Spillway generates: cannot read the label matchers at '{body[pos:][:40]}'")
        value = re.sub(r"\\.", lambda e: _UNESCAPE.get(e.group(0), e.group(0)), m.group(3))
        found.append((m.group(1), m.group(2), value))
        pos = m.end()
    return match.group(1), found


def _label_keys(metadata: Mapping[str, Any], path: str) -> dict[str, str]:
    raw = _annotations(metadata, path).get(LABEL_KEYS_ANNOTATION)
    if raw is None:
        return {}
    where = f"{path}.annotations.{LABEL_KEYS_ANNOTATION}"
    keys: dict[str, str] = {}
    for part in filter(None, str(raw).split(",")):
        prom, sep, key = part.partition("=")
        if not sep or promql.label_name(key) != prom:
            _refuse(where, f"'{part}' is not 'prometheus_label=agent.label.key' (the key's Prometheus name)")
        keys[prom] = key
    return keys


def _threshold_ms(le: str | None) -> float | None:
    """The threshold (ms) whose `le` label promql writes as `le`: export divides by 1000 in floats, so a bucket of
    4.2 ms is le="0.004200000000000001"; of the candidates (the decimal shift, the float product rounded) the one
    that gives the same text back, else the decimal shift (whose query then is refused as not Spillway's)."""
    try:
        shifted = float(Decimal(le or "x").scaleb(3))
        candidates = [shifted, round(float(le or "x") * 1000, 9)]
    except (ArithmeticError, ValueError):
        return None
    if not all(math.isfinite(c) and c > 0 for c in candidates):
        return None
    return next((c for c in candidates if promql.le_value(c / 1000) == le), shifted)


def _indicator(sli: Any, path: str, label_keys: dict[str, str]) -> dict[str, Any]:
    """`sli_kind`, `selector` and `threshold_ms` from an SLI's spec (at `path`) whose queries promql.py wrote."""
    spec = _mapping(sli, path)
    if "thresholdMetric" in spec:
        _refuse(f"{path}.thresholdMetric", "Spillway SLIs are ratios of good to total events: use ratioMetric")
    ratio = _mapping(spec.get("ratioMetric"), f"{path}.ratioMetric")
    at = f"{path}.ratioMetric"
    for field in ("bad", "raw"):
        if field in ratio:
            _refuse(f"{at}.{field}", "Spillway reads good/total ratio metrics (good and total)")
    if ratio.get("counter") is not True:
        _refuse(f"{at}.counter", "must be true: the queries are monotonically increasing counters")
    queries: dict[str, tuple[str, str, list[tuple[str, str, str]]]] = {}
    for which in ("good", "total"):
        source = _mapping(_mapping(ratio.get(which), f"{at}.{which}").get("metricSource"),
                          f"{at}.{which}.metricSource")  # fmt: skip
        where = f"{at}.{which}.metricSource"
        if source.get("type") != "Prometheus":
            _refuse(f"{where}.type", f"'{source.get('type')}' is not a metric source Spillway reads: use Prometheus")
        query_path = f"{where}.spec.query"
        query = _mapping(source.get("spec"), f"{where}.spec").get("query")
        queries[which] = (query_path, *_series(query, query_path))
    total_path, total_metric, total_matchers = queries["total"]
    kind = next((k for k, (base, _) in promql.METRICS.items()
                 if total_metric == (base if k == "availability" else f"{base}_count")), None)  # fmt: skip
    if kind is None:
        known = ", ".join(base if k == "availability" else f"{base}_count" for k, (base, _) in promql.METRICS.items())
        _refuse(total_path, f"'{total_metric}' is not a metric Spillway's SLIs count; one of {known}")
    model_label = promql.METRICS[kind][1]
    selector: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for label, op, value in total_matchers:
        if label == model_label and op == "=":
            selector["model"] = value
        elif label == promql.TENANT_LABEL:
            selector["tenant"] = DEFAULT_TENANT if (op, value) == ("=~", f"{DEFAULT_TENANT}|") else value
        elif label not in (promql.OUTCOME_LABEL, "le"):
            labels[label_keys.get(label, label)] = value
    if labels:
        selector["labels"] = labels
    good_path, _, good_matchers = queries["good"]
    threshold_ms = None
    if kind != "availability":
        le = next((v for label, op, v in good_matchers if label == "le" and op == "="), None)
        threshold_ms = _threshold_ms(le)
        if threshold_ms is None:
            _refuse(good_path, 'not a query Spillway generates: the good series needs le="<threshold in seconds>"')
    try:
        expected = promql.sli_query(kind, selector, threshold_ms)
    except (KeyError, ValueError, TypeError) as exc:
        _refuse(total_path, f"not a query Spillway generates: {exc}")
    for which, want in (("good", expected.good), ("total", expected.total)):
        where, metric, found = queries[which]
        want_metric, want_matchers = _series(want, where)
        if (metric, sorted(found)) != (want_metric, sorted(want_matchers)):
            _refuse(where, f"not a query Spillway generates for a {kind} SLI; it would be {want}")
    return {"sli_kind": kind, "selector": selector, "threshold_ms": threshold_ms}


def _refs(docs: list[_Doc], kind: str) -> dict[str, _Doc]:
    found: dict[str, _Doc] = {}
    for doc in docs:
        if doc.body.get("kind") == kind:
            name = _text(_mapping(doc.body.get("metadata"), f"{doc.path}.metadata").get("name"),
                         f"{doc.path}.metadata.name")  # fmt: skip
            if name in found:
                _refuse(f"{doc.path}.metadata.name", f"a second {kind} named '{name}' (the first is "
                        f"{found[name].path})")  # fmt: skip
            found[name] = doc
    return found


def _resolve(item: Any, path: str, ref_field: str, kind: str, refs: dict[str, _Doc]) -> tuple[dict[str, Any], str]:
    """An inline object (`kind`, `metadata`, `spec`) or a reference to a document of the file: (object, its path)."""
    if isinstance(item, str):  # a bare name, as some tools write references
        item = {ref_field: item}
    item = _mapping(item, path)
    if ref_field in item:
        name = item[ref_field]
        if not isinstance(name, str) or name not in refs:
            _refuse(f"{path}.{ref_field}", f"no {kind} document named '{name}' in this file")
        return refs[name].body, refs[name].path
    if item.get("kind", kind) != kind:
        _refuse(f"{path}.kind", f"must be {kind}")
    return item, path


def _alert(policy_item: Any, path: str, refs: dict[str, dict[str, _Doc]]) -> dict[str, Any]:
    policy, ppath = _resolve(policy_item, path, "alertPolicyRef", "AlertPolicy", refs["AlertPolicy"])
    conditions = _list(_mapping(policy.get("spec"), f"{ppath}.spec").get("conditions"), f"{ppath}.spec.conditions")
    if len(conditions) != 1:
        _refuse(f"{ppath}.spec.conditions", "an OpenSLO alert policy has exactly one condition")
    condition, cpath = _resolve(conditions[0], f"{ppath}.spec.conditions[0]", "conditionRef", "AlertCondition",
                                refs["AlertCondition"])  # fmt: skip
    meta = _mapping(condition.get("metadata"), f"{cpath}.metadata", required=False)
    spec = _mapping(condition.get("spec"), f"{cpath}.spec")
    severity = spec.get("severity")
    if severity not in ("page", "ticket"):
        _refuse(f"{cpath}.spec.severity", f"'{severity}' is not a Spillway severity: page or ticket")
    at = f"{cpath}.spec.condition"
    cond = _mapping(spec.get("condition"), at)
    if cond.get("kind", "burnrate") != "burnrate":
        _refuse(f"{at}.kind", f"'{cond.get('kind')}': Spillway alerts on burn rates only (burnrate)")
    if cond.get("op") != "gte":
        _refuse(f"{at}.op", f"'{cond.get('op')}': a Spillway burn-rate alert fires at or above its threshold (gte)")
    threshold = _number(cond.get("threshold"), f"{at}.threshold")
    long = _duration(cond.get("lookbackWindow"), f"{at}.lookbackWindow")
    after = cond.get("alertAfter")
    if after not in (None, 0, "0m", "0s", "0h"):
        _refuse(f"{at}.alertAfter", "Spillway alerts fire as soon as both windows burn; a delay is not supported "
                "(leave alertAfter out)")  # fmt: skip
    short_text = _annotations(meta, f"{cpath}.metadata").get(SHORT_WINDOW_ANNOTATION)
    if short_text is None:
        short = max(1, (long // 60 + 6) // 12) * 60  # long / 12 in whole minutes, halves rounded up
    else:
        short = _duration(short_text, f"{cpath}.metadata.annotations.{SHORT_WINDOW_ANNOTATION}")
    return {"long": long, "short": short, "burn_rate": threshold, "severity": severity}


@dataclass(frozen=True)
class ImportedSlo:
    """An SLO read from document `document`; `fields` says where each of its fields came from (for errors)."""

    document: int
    slo: SloCreate
    fields: dict[str, str]

    def field(self, name: str) -> str:
        return self.fields.get(name, f"documents[{self.document}]")


def _slo(doc: _Doc, refs: dict[str, dict[str, _Doc]]) -> ImportedSlo:
    p = doc.path
    metadata = _mapping(doc.body.get("metadata"), f"{p}.metadata")
    annotations = _annotations(metadata, f"{p}.metadata")
    spec = _mapping(doc.body.get("spec"), f"{p}.spec")
    fields: dict[str, str] = {}
    data: dict[str, Any] = {}
    name = _text(metadata.get("name"), f"{p}.metadata.name")
    exact = annotations.get(NAME_ANNOTATION)
    if isinstance(exact, str) and _derived_name(name, exact):  # else metadata.name was edited: the edit wins
        data["name"], fields["name"] = exact, f"{p}.metadata.annotations.{NAME_ANNOTATION}"
    else:
        data["name"], fields["name"] = name, f"{p}.metadata.name"
    whole = annotations.get(DESCRIPTION_ANNOTATION)
    if isinstance(whole, str) and spec.get("description") == _cut(whole):  # as exported, not edited
        data["description"] = whole
        fields["description"] = f"{p}.metadata.annotations.{DESCRIPTION_ANNOTATION}"
    elif "description" in spec:
        data["description"], fields["description"] = spec["description"], f"{p}.spec.description"
    elif "displayName" in metadata:
        data["description"], fields["description"] = metadata["displayName"], f"{p}.metadata.displayName"
    # the indicator
    if ("indicator" in spec) == ("indicatorRef" in spec):
        _refuse(f"{p}.spec.indicator", "give exactly one of indicator (inline SLI) and indicatorRef")
    if "indicatorRef" in spec:
        sli, spath = _resolve(spec, f"{p}.spec", "indicatorRef", "SLI", refs["SLI"])
    else:
        sli, spath = _mapping(spec["indicator"], f"{p}.spec.indicator"), f"{p}.spec.indicator"
    sli_meta = _mapping(sli.get("metadata"), f"{spath}.metadata", required=False)
    good = f"{spath}.spec.ratioMetric.good.metricSource.spec.query"
    data.update(_indicator(sli.get("spec"), f"{spath}.spec", _label_keys(sli_meta, f"{spath}.metadata")))
    fields.update(sli_kind=good, threshold_ms=good, selector=f"{spath}.spec.ratioMetric.total.metricSource.spec.query")
    # the window
    if "timeWindow" in spec:
        windows = _list(spec["timeWindow"], f"{p}.spec.timeWindow")
        if len(windows) != 1:
            _refuse(f"{p}.spec.timeWindow", "exactly one time window")
        w = f"{p}.spec.timeWindow[0]"
        window = _mapping(windows[0], w)
        if "calendar" in window:
            _refuse(f"{w}.calendar", "calendar-aligned windows are not supported: Spillway windows are rolling")
        if window.get("isRolling", True) is not True:
            _refuse(f"{w}.isRolling", "must be true: Spillway windows are rolling")
        data["window"], fields["window"] = _duration(window.get("duration"), f"{w}.duration"), f"{w}.duration"
    method = spec.get("budgetingMethod", "Occurrences")
    if method != "Occurrences":
        _refuse(f"{p}.spec.budgetingMethod", f"'{method}': Spillway counts good and total events (Occurrences)")
    # the objective
    objectives = _list(spec.get("objectives"), f"{p}.spec.objectives")
    if len(objectives) != 1:
        _refuse(f"{p}.spec.objectives", f"{len(objectives)} objectives: a Spillway SLO has exactly one")
    o = f"{p}.spec.objectives[0]"
    objective = _mapping(objectives[0], o)
    for field, why in (("op", "threshold metrics"), ("value", "threshold metrics"), ("indicator", "composite SLOs"),
                       ("indicatorRef", "composite SLOs"), ("timeSliceTarget", "time slices"),
                       ("timeSliceWindow", "time slices")):  # fmt: skip
        if field in objective:
            _refuse(f"{o}.{field}", f"{why} are not supported")
    if ("target" in objective) == ("targetPercent" in objective):
        _refuse(f"{o}.target", "give exactly one of target (a ratio such as 0.995) and targetPercent")
    if "target" in objective:
        data["objective"] = _objective(_number(objective["target"], f"{o}.target"))
        fields["objective"] = f"{o}.target"
    else:
        data["objective"] = _number(objective["targetPercent"], f"{o}.targetPercent")
        fields["objective"] = f"{o}.targetPercent"
    # the alerts
    policies = _list(spec.get("alertPolicies", []), f"{p}.spec.alertPolicies")
    data["alert_windows"] = [_alert(item, f"{p}.spec.alertPolicies[{i}]", refs) for i, item in enumerate(policies)]
    for i in range(len(policies)):
        fields[f"alert_windows.{i}"] = f"{p}.spec.alertPolicies[{i}]"
    fields["alert_windows"] = f"{p}.spec.alertPolicies"
    try:
        slo = SloCreate.model_validate(data)
    except ValidationError as exc:
        details = []
        for err in exc.errors():
            loc = [str(x) for x in err["loc"]]
            key = ".".join(loc[:2]) if loc[:1] == ["alert_windows"] and len(loc) > 1 else (loc[0] if loc else "")
            details.append({"field": fields.get(key, p), "message": err["msg"].removeprefix("Value error, ")})
        raise ValidationFailed(f"{details[0]['field']}: {details[0]['message']}", details=details) from exc
    return ImportedSlo(doc.index, slo, fields)


def _documents(raw: list[Any]) -> Iterator[_Doc]:
    for i, body in enumerate(raw):
        doc = _Doc(i, body if isinstance(body, dict) else {})
        if not isinstance(body, dict):
            _refuse(doc.path, "must be an OpenSLO object (apiVersion, kind, metadata, spec)")
        if body.get("apiVersion") != API_VERSION:
            _refuse(f"{doc.path}.apiVersion", f"'{body.get('apiVersion')}': Spillway reads {API_VERSION}")
        if not isinstance(body.get("kind"), str) or body["kind"] not in KINDS:
            _refuse(f"{doc.path}.kind", f"'{body.get('kind')}' is not an OpenSLO v1 kind")
        yield doc


def parse(text: str) -> list[ImportedSlo]:
    """The SLOs of an OpenSLO v1 YAML text (one or more documents), in document order.

    Raises:
        ValidationFailed: not YAML, no SLO, or what Spillway cannot store, each named by its path
            (`documents[<index>].spec...`); every refused SLO document is listed in the details.
    """
    raw = load_documents(text)
    try:
        docs = list(_documents(raw))
        refs = {kind: _refs(docs, kind) for kind in ("SLI", "AlertPolicy", "AlertCondition")}
    except _Refused as exc:
        raise ValidationFailed.field(exc.path, exc.message) from exc
    found: list[ImportedSlo] = []
    details: list[dict[str, str]] = []
    names: dict[str, str] = {}
    for doc in docs:
        if doc.body.get("kind") != "SLO":
            continue
        try:
            imported = _slo(doc, refs)
        except _Refused as exc:
            details.append({"field": exc.path, "message": exc.message})
            continue
        except ValidationFailed as exc:
            details.extend(exc.details)
            continue
        name = imported.slo.name
        if name in names:
            details.append({"field": imported.field("name"), "message": f"'{name}' is also the SLO of {names[name]}"})
            continue
        names[name] = doc.path
        found.append(imported)
    if details:
        more = f" (and {len(details) - 1} more)" if len(details) > 1 else ""
        raise ValidationFailed(f"{details[0]['field']}: {details[0]['message']}{more}", details=details)
    if not found:
        raise ValidationFailed.field("body", "no SLO document (kind: SLO, apiVersion: openslo/v1) in the YAML")
    return found


__all__ = [
    "ANNOTATION",
    "API_VERSION",
    "LABEL_KEYS_ANNOTATION",
    "NAME_ANNOTATION",
    "SHORT_WINDOW_ANNOTATION",
    "ImportedSlo",
    "dns_label",
    "document",
    "dump",
    "dump_all",
    "load_documents",
    "parse",
]
