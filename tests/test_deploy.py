"""deploy/: the dashboard and the alert rules query only catalogued metrics, and promtool agrees.

promtool comes from Debian's prometheus package; ``scripts/check-alert-rules.sh`` installs it
when it is missing. The promtool tests skip (loudly) only where neither promtool nor apt-get
exists, and never when ``CI`` is set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from meridian.telemetry.catalogue import CATALOGUE, MetricKind

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "meridian-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
SCRIPT = ROOT / "scripts" / "check-alert-rules.sh"

# vLLM metrics the dashboard and rules may use: checked against vllm/v1/metrics/loggers.py of
# vLLM 0.32 (exposition names: counters with _total, histograms with _bucket/_sum/_count).
VLLM_ALLOWED = frozenset(
    {
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:generation_tokens_total",
        "vllm:kv_cache_usage_perc",
    }
)

MERIDIAN_TOKEN = re.compile(r"meridian_[a-z_]+")
VLLM_TOKEN = re.compile(r"vllm:[a-z_:]+")
HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")
CATALOGUED = frozenset(spec.name for spec in CATALOGUE)
HISTOGRAMS = frozenset(spec.name for spec in CATALOGUE if spec.kind is MetricKind.HISTOGRAM)


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_exprs() -> list[str]:
    """Every PromQL string of the dashboard: panel targets and template-variable queries."""
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dashboard())
    return found


def alert_exprs() -> list[str]:
    """The ``expr: |`` blocks of alerts.yml (this file's layout; promtool parses it for real)."""
    exprs: list[str] = []
    lines = ALERTS.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("expr:"):
            indent = len(line) - len(line.lstrip())
            inline = line.split("expr:", 1)[1].strip()
            block = [] if inline in ("|", ">", "|-", ">-") else [inline]
            i += 1
            while i < len(lines) and (
                not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent
            ):
                block.append(lines[i].strip())
                i += 1
            exprs.append(" ".join(block).strip())
        else:
            i += 1
    return exprs


def metric_base(token: str) -> str:
    """A PromQL metric token as a catalogue name (histogram series lose their suffix)."""
    if token in CATALOGUED:
        return token
    base = HISTOGRAM_SUFFIX.sub("", token)
    return base if base in HISTOGRAMS else token


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_queried_metric_is_catalogued(source: str) -> None:
    exprs = dashboard_exprs() if source == "dashboard" else alert_exprs()
    assert exprs
    used: set[str] = set()
    for expr in exprs:
        for token in MERIDIAN_TOKEN.findall(expr):
            base = metric_base(token)
            assert base in CATALOGUED, f"{source} queries {token}, which is not in the catalogue"
            used.add(base)
        for token in VLLM_TOKEN.findall(expr):
            assert token in VLLM_ALLOWED, f"{source} queries {token}, not a known vLLM metric"
    assert used


def test_a_loose_parse_would_catch_a_typo() -> None:
    assert metric_base("meridian_output_itl_seconds_bucket") in CATALOGUED
    assert metric_base("meridian_queue_depth_bucket") not in CATALOGUED  # a gauge has no buckets
    assert metric_base("meridian_budget_force_total") not in CATALOGUED


def test_alert_rules_cover_the_issue() -> None:
    text = ALERTS.read_text()
    alerts = re.findall(r"- alert: (\w+)", text)
    assert {
        "MeridianOutputCriticalEviction",
        "MeridianKvCacheNearlyFull",
        "MeridianThinkBacklogWithoutForcing",
        "MeridianHardCapDominatesForcing",
        "MeridianTrackedRequestsGrowing",
    } <= set(alerts)
    assert len(alert_exprs()) == len(alerts)


def test_dashboard_shows_vllm_latency_next_to_meridian() -> None:
    exprs = " ".join(dashboard_exprs())
    for needle in (
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:time_to_first_token_seconds_bucket",
        "meridian_output_itl_seconds_bucket",
        "meridian_ttfvt_seconds_bucket",
        "meridian_queue_depth",
        "meridian_budget_forces_total",
        "meridian_kv_used_bytes",
        "meridian_kv_evicted_blocks_total",
    ):
        assert needle in exprs, needle


def test_dashboard_layout_is_sane() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}"
            assert p.get("description"), p["title"]


# -- promtool -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def promtool() -> str:
    """Run the check script once (it installs promtool when missing); promtool's path."""
    if shutil.which("promtool") is None and shutil.which("apt-get") is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing and apt-get unavailable; CI must check the rules")
        pytest.skip(
            "SKIPPED LOUDLY: promtool is not installed and apt-get is unavailable on this "
            "machine, so the alert rules were NOT checked; install promtool to run this test"
        )
    run = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"check-alert-rules.sh failed:\n{run.stdout}\n{run.stderr}"
    assert "SUCCESS" in run.stdout
    path = shutil.which("promtool")
    assert path is not None
    return path


def test_check_script_accepts_the_rules(promtool: str) -> None:
    assert Path(promtool).name == "promtool"


def test_promtool_rejects_a_broken_rule(promtool: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text(
        "groups:\n  - name: x\n    rules:\n      - alert: X\n"
        "        expr: sum by (job (meridian_tracked_requests)\n"
    )
    run = subprocess.run([promtool, "check", "rules", str(bad)], capture_output=True, text=True)
    assert run.returncode != 0


def test_dashboard_promql_parses(promtool: str, tmp_path: Path) -> None:
    # promtool parses rule expressions: every dashboard query becomes a recording rule, with
    # Grafana's variables replaced by what Grafana would substitute.
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for i, expr in enumerate(dashboard_exprs()):
        if expr.startswith("label_values("):
            continue  # a Grafana function, not PromQL
        promql = (
            expr.replace("$__rate_interval", "1m").replace("$job", ".*").replace("$instance", ".*")
        )
        rules += [f"      - record: dashboard:query_{i}", f"        expr: {json.dumps(promql)}"]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text("\n".join(rules) + "\n")
    run = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def rules_without_annotations(dest: Path) -> Path:
    """alerts.yml minus its annotation blocks (promtool compares annotations exactly)."""
    out: list[str] = []
    skip_deeper_than: int | None = None
    for line in ALERTS.read_text().splitlines():
        indent = len(line) - len(line.lstrip())
        if skip_deeper_than is not None:
            if not line.strip() or indent > skip_deeper_than:
                continue
            skip_deeper_than = None
        if line.strip() == "annotations:":
            skip_deeper_than = indent
            continue
        out.append(line)
    dest.write_text("\n".join(out) + "\n")
    return dest


# Synthetic series, 1-minute samples; each alert must fire where it should and nowhere else.
ALERT_TESTS = """
rule_files:
  - {rules}
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'meridian_output_critical_evictions_total{{job="m",instance="a"}}'
        values: '0x10 2x10'
      - series: 'meridian_output_critical_evictions_total{{job="m",instance="b"}}'
        values: '0x20'
    alert_rule_test:
      - {{eval_time: 9m, alertname: MeridianOutputCriticalEviction, exp_alerts: []}}
      - eval_time: 12m
        alertname: MeridianOutputCriticalEviction
        exp_alerts: [{{exp_labels: {{severity: warning, job: m, instance: a}}}}]
      - {{eval_time: 20m, alertname: MeridianOutputCriticalEviction, exp_alerts: []}}

  - interval: 1m
    input_series:
      - series: 'meridian_kv_used_bytes{{job="m",instance="a",tier="output_critical"}}'
        values: '45x30'
      - series: 'meridian_kv_used_bytes{{job="m",instance="a",tier="think_active"}}'
        values: '50x30'
      - series: 'meridian_kv_capacity_bytes{{job="m",instance="a"}}'
        values: '100x30'
      - series: 'meridian_kv_used_bytes{{job="m",instance="b",tier="output_critical"}}'
        values: '80x30'
      - series: 'meridian_kv_capacity_bytes{{job="m",instance="b"}}'
        values: '100x30'
    alert_rule_test:
      - {{eval_time: 5m, alertname: MeridianKvCacheNearlyFull, exp_alerts: []}}
      - eval_time: 15m
        alertname: MeridianKvCacheNearlyFull
        exp_alerts: [{{exp_labels: {{severity: warning, job: m, instance: a}}}}]

  - interval: 1m
    input_series:
      - series: 'meridian_queue_depth{{job="m",instance="a",phase="think"}}'
        values: '2x60 40x20'
      - series: 'meridian_budget_forces_total{{job="m",instance="a",reason="converged"}}'
        values: '0x80'
      - series: 'meridian_queue_depth{{job="m",instance="b",phase="think"}}'
        values: '2x60 40x20'
      - series: 'meridian_budget_forces_total{{job="m",instance="b",reason="converged"}}'
        values: '0+1x80'
    alert_rule_test:
      - {{eval_time: 60m, alertname: MeridianThinkBacklogWithoutForcing, exp_alerts: []}}
      - eval_time: 68m
        alertname: MeridianThinkBacklogWithoutForcing
        exp_alerts:
          - exp_labels: {{severity: warning, job: m, instance: a, phase: think}}

  - interval: 1m
    input_series:
      - series: 'meridian_budget_forces_total{{job="m",instance="a",reason="hard_cap"}}'
        values: '0+1x70'
      - series: 'meridian_budget_forces_total{{job="m",instance="a",reason="converged"}}'
        values: '0+0.5x70'
      - series: 'meridian_budget_forces_total{{job="m",instance="b",reason="hard_cap"}}'
        values: '0+1x70'
      - series: 'meridian_budget_forces_total{{job="m",instance="b",reason="converged"}}'
        values: '0+2x70'
      - series: 'meridian_budget_forces_total{{job="m",instance="c",reason="hard_cap"}}'
        values: '0+0.1x70'
    alert_rule_test:
      - eval_time: 65m
        alertname: MeridianHardCapDominatesForcing
        exp_alerts: [{{exp_labels: {{severity: info, job: m, instance: a}}}}]

  - interval: 1m
    input_series:
      - series: 'meridian_tracked_requests{{job="m",instance="a"}}'
        values: '10+1x40'
      - series: 'meridian_tracked_requests{{job="m",instance="b"}}'
        values: '10x40'
      - series: 'meridian_tracked_requests{{job="m",instance="c"}}'
        values: '10+1x10 20-1x10 10+1x20'
    alert_rule_test:
      - {{eval_time: 10m, alertname: MeridianTrackedRequestsGrowing, exp_alerts: []}}
      - eval_time: 20m
        alertname: MeridianTrackedRequestsGrowing
        exp_alerts: [{{exp_labels: {{severity: warning, job: m, instance: a}}}}]

  - interval: 1m
    input_series:
      - series: 'vllm:num_requests_running{{job="m",instance="a",model_name="x",engine="0"}}'
        values: '1x20'
      - series: 'meridian_tracked_requests{{job="m",instance="a"}}'
        values: '1x20'
      - series: 'vllm:num_requests_running{{job="m",instance="z",model_name="x",engine="0"}}'
        values: '1x20'
    alert_rule_test:
      - {{eval_time: 5m, alertname: MeridianMetricsAbsent, exp_alerts: []}}
      - eval_time: 15m
        alertname: MeridianMetricsAbsent
        exp_alerts: [{{exp_labels: {{severity: warning, job: m, instance: z}}}}]
"""


def test_alerts_fire_on_synthetic_series(promtool: str, tmp_path: Path) -> None:
    rules = rules_without_annotations(tmp_path / "alerts.yml")
    tests = tmp_path / "alerts_test.yml"
    tests.write_text(ALERT_TESTS.format(rules=rules))
    run = subprocess.run(
        [promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
