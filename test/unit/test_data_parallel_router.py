"""Request routing over data-parallel scheduler replicas."""

import pytest

from srt.http_server.dp_router import DataParallelRouter


def test_round_robin_cycles_over_ranks():
    router = DataParallelRouter(3)
    assert [router.route(f"r{i}") for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_shortest_queue_prefers_least_loaded_and_tracks_finishes():
    router = DataParallelRouter(2, "shortest_queue")
    assert [router.route(r) for r in ("a", "b", "c")] == [0, 1, 0]
    router.finished("a")
    router.finished("c")
    assert router.load == [0, 1]
    assert router.route("d") == 0
    router.finished("unknown")  # finishing twice or an unknown rid changes nothing
    assert router.load == [1, 1]


def test_aborts_go_to_the_owner_or_everyone():
    router = DataParallelRouter(2)
    router.route("a")
    router.route("b")
    assert router.ranks_for_abort("b") == [1]
    assert router.ranks_for_abort("") == [0, 1]
    assert router.ranks_for_abort("gone") == []


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match="load balance"):
        DataParallelRouter(2, "random")
