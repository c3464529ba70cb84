"""TTFK bookkeeping transitions and the policies' orderings."""

import pytest

from carma.core import Policy
from carma.core.policies import Candidate, RoundRobin, order
from carma.core.ttfk import TtfkTable


@pytest.fixture
def table():
    return TtfkTable([0, 1], window_s=30.0)


def test_dispatch_invalidates_only_that_gpu(table):
    table.dispatched(0, task=7, now=10.0)
    assert not table.valid(0, 10.0)
    assert table.valid(1, 10.0)


def test_gpu_is_valid_again_one_window_after_the_first_kernel(table):
    table.dispatched(0, 7, 10.0)
    assert not table.valid(0, 500.0)  # no kernel seen yet: waits however long it takes
    assert table.seen(0, 7, 500.0) is True
    assert table.seen(0, 7, 501.0) is False  # only the first sighting counts
    assert not table.valid(0, 529.9)
    assert table.next_expiry(510.0) == 530.0
    assert table.valid(0, 530.0)
    assert table.next_expiry(530.0) is None


def test_a_dying_task_releases_its_gpu_at_once(table):
    table.dispatched(0, 7, 10.0)
    table.ended(7)
    assert table.valid(0, 10.0)
    table.dispatched(1, 8, 20.0)
    table.seen(1, 8, 25.0)
    table.ended(8)
    assert table.valid(1, 26.0)


def test_sighting_of_an_unknown_task_changes_nothing(table):
    assert table.seen(0, 99, 5.0) is False
    assert table.valid(0, 5.0)


def _cands(*specs):
    return [Candidate(gpu, free, smact) for gpu, free, smact in specs]


CANDS = _cands((0, 10_000, 0.5), (1, 30_000, 0.7), (2, 30_000, 0.2), (3, 5_000, 0.2))


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (Policy.MAGM, [1, 2, 0, 3]),  # most free first; tie 1/2 to the lower index
        (Policy.LUG, [2, 3, 0, 1]),  # least SMACT first; tie 2/3 to the lower index
        (Policy.BF, [3, 0, 1, 2]),  # least free (all candidates already fit)
        (Policy.FF, [0, 1, 2, 3]),
        (Policy.EXCLUSIVE, [0, 1, 2, 3]),
    ],
)
def test_policy_orders(policy, expected):
    assert [c.gpu for c in order(policy, CANDS, RoundRobin([0, 1, 2, 3]))] == expected


def test_round_robin_continues_after_the_last_gpu_placed():
    rr = RoundRobin([0, 1, 2])
    assert [c.gpu for c in rr.order(_cands((0, 1, 0), (1, 1, 0), (2, 1, 0)))] == [0, 1, 2]
    rr.placed([0])
    assert [c.gpu for c in rr.order(_cands((0, 1, 0), (2, 1, 0)))] == [2, 0]  # GPU 1 not a candidate
    rr.placed([2])
    assert [c.gpu for c in rr.order(_cands((0, 1, 0), (1, 1, 0), (2, 1, 0)))] == [0, 1, 2]
    rr.placed([0, 1])  # a two-GPU task moves the pointer past its last GPU
    assert rr.order(_cands((0, 1, 0), (1, 1, 0), (2, 1, 0)))[0].gpu == 2


def test_round_robin_pointer_moves_only_on_placement():
    rr = RoundRobin([0, 1, 2])
    for _ in range(3):
        assert rr.order(_cands((1, 1, 0), (2, 1, 0)))[0].gpu == 1
