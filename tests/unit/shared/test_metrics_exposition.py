"""The Prometheus exposition of both daemons: naming rules, ``promtool check metrics``, and the
docs table and Grafana dashboard naming only metrics that exist.

Both daemons build the same ``shared.metrics.Metrics`` (each on its own registry), so one
fully populated ``Metrics`` renders everything either daemon can expose. It is populated by
this module, so it cannot tell whether the daemons set a metric:
``tests/integration/test_metrics.py`` fails for a declared metric no production code sets.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from shared.metrics import Metrics

ROOT = Path(__file__).resolve().parents[3]
UNIT_SUFFIXES = ("_seconds", "_bytes")


def declared(metrics: Metrics) -> dict[str, MetricWrapperBase]:
    """Every metric object of ``metrics``, by attribute name."""
    return {k: v for k, v in vars(metrics).items() if isinstance(v, MetricWrapperBase)}


def touched_metrics() -> Metrics:
    """A ``Metrics`` whose every metric has one sample, so labelled series are exposed."""
    metrics = Metrics()
    for metric in declared(metrics).values():
        labels = getattr(metric, "_labelnames", ())
        child = metric.labels(*["x"] * len(labels)) if labels else metric
        if isinstance(child, Counter):
            child.inc()
        elif isinstance(child, Gauge):
            child.set(1)
        elif isinstance(child, Histogram):
            child.observe(0.01)
        else:  # pragma: no cover - a new metric type needs a line above
            raise AssertionError(f"untested metric type {type(child).__name__}")
    return metrics


def exposition() -> str:
    return generate_latest(touched_metrics().registry).decode()


def declared_types(text: str) -> dict[str, str]:
    """``{family name: type}`` from the ``# TYPE`` lines, without prometheus_client's
    ``_created`` companions of counters and histograms."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))
    return {n: t for n, t in types.items() if not n.endswith("_created")}


def test_every_declared_metric_renders_as_one_family_with_a_sample() -> None:
    # Arrange
    metrics = touched_metrics()

    # Act
    text = generate_latest(metrics.registry).decode()

    # Assert
    families = declared_types(text)
    assert len(families) == len(declared(metrics))
    for name in families:
        assert re.search(rf"^{name}(_bucket|_count|_sum)?[{{ ]", text, flags=re.MULTILINE), name


def test_names_are_prefixed_and_suffixed() -> None:
    families = declared_types(exposition())

    for name, kind in families.items():
        assert name.startswith("neuroshard_"), name
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), f"{name} is a {kind} named like a counter"
        if kind == "histogram":
            assert name.endswith(UNIT_SUFFIXES), f"{name}: histograms carry a unit suffix"


def test_promtool_check_metrics_passes() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (Debian package 'prometheus'); exposition not linted")
    text = exposition()

    done = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "", done.stdout


def test_docs_table_lists_every_metric() -> None:
    families = declared_types(exposition())
    table = (ROOT / "docs" / "metrics.md").read_text()

    documented = set(re.findall(r"^\| `(neuroshard_\w+)`", table, flags=re.MULTILINE))

    assert documented == set(families)
    for name, kind in families.items():
        assert re.search(rf"^\| `{name}` \| {kind} \|", table, flags=re.MULTILINE), name


def test_dashboard_queries_name_existing_metrics() -> None:
    families = declared_types(exposition())
    series = set(families) | {f"{n}_{s}" for n in families for s in ("bucket", "count", "sum")}
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "neuroshard.json").read_text())

    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bneuroshard_\w+", e)}

    assert exprs
    assert used <= series, sorted(used - series)
    assert {n.removesuffix("_total") for n in families} <= {
        re.sub(r"_(bucket|count|sum|total)$", "", u) for u in used
    }, "every metric has a panel"
