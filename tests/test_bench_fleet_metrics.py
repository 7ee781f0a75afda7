"""scripts/bench_fleet.py reads the services' own latency histograms as Prometheus's histogram_quantile does:
checked against a real registry fed known values."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram, generate_latest

_SPEC = importlib.util.spec_from_file_location("bench_fleet",
                                               Path(__file__).resolve().parents[1] / "scripts" / "bench_fleet.py")
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def _exposition(values: dict[str, list[float]]) -> str:
    registry = CollectorRegistry()
    h = Histogram("x_seconds", "test", ["result"], buckets=(0.01, 0.02, 0.05, 0.1), registry=registry)
    for result, seconds in values.items():
        for s in seconds:
            h.labels(result=result).observe(s)
    return generate_latest(registry).decode()


def test_p99_is_interpolated_within_its_bucket_over_the_series_summed() -> None:
    # 100 answers: 50 placed under 10 ms, 40 no_room in (10, 20] ms, 10 placed in (20, 50] ms; rank 99 falls
    # 9 of the 10 into the (20, 50] bucket: 20 + 30 * 9 / 10 = 47 ms
    text = _exposition({"placed": [0.005] * 50 + [0.03] * 10, "no_room": [0.015] * 40})
    got = bench.histogram_p99(text, "x_seconds")
    assert got["n"] == 100 and abs(got["p99"] - 47.0) < 1e-6
    placed = bench.histogram_p99(text, "x_seconds", result="placed")  # 60: rank 59.4, 9.4 of 10 into (20, 50]
    assert placed["n"] == 60 and abs(placed["p99"] - 48.2) < 1e-6


def test_past_the_last_bound_it_says_the_last_bound_and_nothing_counted_is_nan() -> None:
    text = _exposition({"placed": [0.5] * 3})
    assert bench.histogram_p99(text, "x_seconds")["p99"] == 100.0  # histogram_quantile's answer past the top
    got = bench.histogram_p99(text, "x_seconds", result="error")
    assert got["n"] == 0 and got["p99"] != got["p99"]


def test_between_two_scrapes_only_what_came_in_between_counts() -> None:
    before = _exposition({"placed": [0.005] * 50})
    after = _exposition({"placed": [0.005] * 50 + [0.03] * 10})
    got = bench.p99_between(before, after, "x_seconds")
    assert got["n"] == 10 and abs(got["p99"] - (20 + 30 * 9.9 / 10)) < 1e-6  # all ten in (20, 50]
    assert bench.p99_between(before, after, "x_seconds", result="error")["n"] == 0


def test_the_fleets_own_changes_are_read_from_the_churns_log_within_the_window(tmp_path: Path) -> None:
    log = tmp_path / "churn.log"
    assert bench.fleet_changes(log, 0.0) is None  # no log (the churn never ran)
    # before the window, inside it, and a line the killed churn left half-written
    log.write_text("10.0 9.0 9.5\n20.5 1.0 4.0\n21.0 3.0 6.0\n22.0 2.0 5.0\n23.0 2.5")
    got = bench.fleet_changes(log, 20.0)
    assert got is not None
    assert (got["n"], got["p50"], got["max"], got["mean"]) == (3, 2.0, 3.0, 2.0)
    assert (got["summed"]["n"], got["summed"]["p50"], got["summed"]["max"]) == (3, 5.0, 6.0)  # the sums after
    assert bench.fleet_changes(log, 30.0) is None
