"""``kvcore.stats``: the one percentile and the one /metrics parser.

The percentile methods are checked against numpy and against the definitions they replaced,
copied here as they were, on the quantiles their callers show: the numbers in summary.json,
the replay, fidelity, bench and demo tables and the drill report are the same as before.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
import pytest

from kvroute.health.scrape import parse_vllm_metrics
from kvroute.kvcore.stats import parse_metrics, percentile

# ------------------------------------------------------------ the definitions replaced


def old_simulator(values: list[float], q: float) -> float:  # simulator/fleet/results.py
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def old_live(values: list[float], q: float) -> float | None:  # simulator/traces/live.py
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def old_overhead(sorted_values: list[float], pct: float) -> float:  # bench/loadgen.py
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(pct / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def old_index_bench(values: Sequence[float], q: float) -> float:  # bench/index_bench.py
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def old_chat_load(values: Sequence[float], q: float) -> float:  # bench/chat_load.py
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def old_drill_p99(values: list[float]) -> str:  # drill/run.py
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{1000 * ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]:.0f} ms"


def samples(seed: int) -> list[list[float]]:
    """Sample sets of every size up to 300 (and some larger), with ties and without."""
    rng = random.Random(seed)
    out = []
    for n in [*range(1, 301), 1000, 1001, 4096, 10_000]:
        if n % 3 == 0:
            out.append([float(rng.randint(0, 20)) for _ in range(n)])  # many ties
        else:
            out.append([rng.expovariate(20.0) for _ in range(n)])
    return out


QUANTILES = (0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0)


def test_each_method_gives_what_its_callers_gave_before() -> None:
    for values in samples(1):
        shuffled = values[:]
        random.Random(len(values)).shuffle(shuffled)
        for q in QUANTILES:
            assert percentile(shuffled, q) == old_simulator(shuffled, q)
            assert percentile(shuffled, q, method="nearest_rank") == old_live(shuffled, q)
            assert percentile(shuffled, q, method="rank_above") == old_chat_load(shuffled, q)
        for pct in (50, 99):
            q = pct / 100
            assert percentile(shuffled, q, method="nearest_rank") == old_overhead(
                sorted(shuffled), pct
            )
            assert percentile(shuffled, q, method="nearest") == old_index_bench(shuffled, pct)
        p99 = percentile(shuffled, 0.99, method="nearest_rank")
        assert f"{1000 * p99:.0f} ms" == old_drill_p99(shuffled)


def test_methods_match_numpy() -> None:
    numpy_name = {"nearest_rank": "inverted_cdf", "nearest": "nearest"}
    for values in samples(2)[:120]:
        for q in QUANTILES:
            assert percentile(values, q) == pytest.approx(np.quantile(values, q), rel=1e-12)
            for ours, theirs in numpy_name.items():
                assert percentile(values, q, method=ours) == np.quantile(values, q, method=theirs)  # type: ignore[call-overload]


def test_small_cases_and_empty_input() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5, method="nearest_rank") == 50.0
    assert percentile(values, 0.99, method="nearest_rank") == 99.0
    assert percentile(values, 0.5, method="rank_above") == 51.0  # one rank above at whole q*n
    assert percentile(values, 0.5) == 50.5
    assert percentile([7.0], 0.99, method="nearest_rank") == 7.0
    for method in ("linear", "nearest_rank", "rank_above", "nearest"):
        assert math.isnan(percentile([], 0.5, method=method))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown percentile method"):
        percentile([1.0], 0.5, method="median")  # type: ignore[arg-type]
    assert percentile(iter([3.0, 1.0, 2.0]), 0.5) == 2.0  # any iterable


# ------------------------------------------------------------------------- /metrics

VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 4.0
# HELP vllm:num_requests_waiting_by_reason Requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 100.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.75
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 500.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7e9
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 640.0
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 32.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 7.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 2.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 9.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 9.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 1.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",num_gpu_blocks="64"} 1.0
"""

OLD_VLLM_PAGE = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="tiny"} 0.5
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{model_name="tiny"} 80.0
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits_total{model_name="tiny"} 16.0
"""


def test_lookups_by_sample_or_family_name_and_labels() -> None:
    page = parse_metrics(VLLM_PAGE)
    assert page.sum("vllm:prefix_cache_queries_total") == 1500.0
    assert page.sum("vllm:prefix_cache_queries") == 1500.0  # a counter by its family name
    assert page.sum("vllm:prefix_cache_queries_created") == 1.7e9  # not in the counter's sum
    assert page.sum("vllm:request_success", finished_reason="length") == 7.0
    assert page.sum("vllm:request_success", finished_reason="nope") == 0.0
    assert page.sum("vllm:num_requests_waiting") == 7.0  # not the *_by_reason gauge
    assert page.sum("vllm:time_to_first_token_seconds_count") == 9.0
    assert page.sum("vllm:time_to_first_token_seconds_bucket", le="0.1") == 4.0
    assert page.series("vllm:kv_cache_usage_perc", engine="1") == [
        ({"engine": "1", "model_name": "tiny"}, 0.75)
    ]
    assert "vllm:num_requests_running" in page
    assert "vllm:prefix_cache_hits" in page and "vllm:prefix_cache_hits_total" in page
    assert "vllm:no_such_metric" not in page
    assert page.sum("vllm:no_such_metric") == 0.0 and page.series("vllm:no_such_metric") == []


def test_declared_families_without_samples_are_present() -> None:
    text = (
        "# HELP kvroute_replica_prefix_cache_hits_tokens hits\n"
        "# TYPE kvroute_replica_prefix_cache_hits_tokens gauge\n"
        "# HELP kvroute_retries counts\n"
        "# TYPE kvroute_retries counter\n"
    )
    page = parse_metrics(text)
    assert "kvroute_replica_prefix_cache_hits_tokens" in page
    assert "kvroute_retries_total" in page and "kvroute_retries" in page
    assert page.sum("kvroute_replica_prefix_cache_hits_tokens") == 0.0


def test_only_parses_the_named_lines_of_str_or_bytes() -> None:
    for text in (VLLM_PAGE, VLLM_PAGE.encode()):
        page = parse_metrics(text, only=("vllm:prefix_cache_hits", "vllm:cache_config_info"))
        assert page.sum("vllm:prefix_cache_hits") == 672.0
        assert "vllm:prefix_cache_queries" not in page
        assert "vllm:time_to_first_token_seconds_count" not in page


def test_a_malformed_page_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_metrics('vllm:num_requests_running{engine="0" 1.0\n')


def test_the_router_reads_a_vllm_page_as_before() -> None:
    report = parse_vllm_metrics(VLLM_PAGE.encode())
    assert (report.waiting, report.running) == (7, 3)
    assert report.kv_usage == 0.5  # the mean over the two engines
    assert (report.prefix_queries, report.prefix_hits) == (1500.0, 672.0)
    assert report.block_size == 32
    old = parse_vllm_metrics(OLD_VLLM_PAGE.encode())
    assert (old.kv_usage, old.prefix_queries, old.prefix_hits) == (0.5, 80.0, 16.0)
    assert (old.waiting, old.running, old.block_size) == (None, None, None)
    empty = parse_vllm_metrics(b"")
    assert (empty.waiting, empty.kv_usage, empty.prefix_queries, empty.prefix_hits) == (None,) * 4
