"""zstore.testing.spawn_ranks: reports come back, and a rank that dies is named at once."""

from __future__ import annotations

import pytest
import workers

from zstore.testing import spawn_ranks


def test_every_rank_reports_through_the_barrier():
    got = spawn_ranks(workers.rank_report, 3, lambda r, b, q: (r, -1, b, q), timeout=300)
    assert sorted(got) == [0, 1, 2]


def test_a_rank_that_raises_is_named_and_the_others_are_stopped():
    # the other ranks wait at the barrier for the one that failed: without the exit
    # codes watched, the parent waited the whole timeout and raised queue.Empty
    with pytest.raises(RuntimeError, match=r"rank 2 of 3 exited with code 1 before its report"):
        spawn_ranks(workers.rank_report, 3, lambda r, b, q: (r, 2, b, q), timeout=60)


def test_a_rank_that_sends_no_report_is_an_error():
    with pytest.raises(RuntimeError, match=r"all 3 ranks exited, 2 with a report"):
        spawn_ranks(workers.rank_without_report, 3, lambda r, b, q: (r, b, q), timeout=60)
