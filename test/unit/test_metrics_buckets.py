"""Bucket lists are the documented ones (docs/metrics.md, "Buckets")."""

from srt.metrics.buckets import (
    KV_RESIDENCY_BUCKETS,
    RETRACTION_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    one_two_five_buckets,
    powers_of_two_buckets,
)


def test_ttft_has_fine_cpu_end_then_sglang_list():
    assert TIME_TO_FIRST_TOKEN_BUCKETS[:8] == (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1)
    assert TIME_TO_FIRST_TOKEN_BUCKETS[-1] == 400
    assert list(TIME_TO_FIRST_TOKEN_BUCKETS) == sorted(set(TIME_TO_FIRST_TOKEN_BUCKETS))


def test_one_two_five_reaches_the_context_length():
    assert one_two_five_buckets(8192) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
    assert one_two_five_buckets(1000)[-1] == 1000


def test_powers_of_two_cover_the_largest_batch():
    assert powers_of_two_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 128]


def test_kv_residency_is_21_geometric_buckets_from_1ms_to_30min():
    b = KV_RESIDENCY_BUCKETS
    assert len(b) == 21 and b[0] == 0.001 and b[-1] == 1800
    ratios = [y / x for x, y in zip(b, b[1:], strict=False)]
    assert all(1.8 < r < 2.3 for r in ratios)


def test_retraction_buckets():
    assert RETRACTION_BUCKETS == (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 20, 25, 30, 40, 50, 75, 100)
