"""TTFK bookkeeping transitions and the policies' orderings."""

import pytest

from carma.core.policies import POLICIES
from carma.core.risk import Risk
from carma.core.ttfk import TtfkTable


@pytest.fixture
def table():
    table = TtfkTable(window_s=30.0)
    for gpu in (0, 1):
        table.add(gpu)
    return table


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


class View:
    """Free memory (MiB, less the reserve) and SMACT risk per GPU: what the policies order by."""

    def __init__(self, *specs: tuple[int, int, float | None]) -> None:
        self._free = {gpu: free for gpu, free, _ in specs}
        self._smact = {gpu: smact for gpu, _, smact in specs}
        self.gpus = dict.fromkeys(self._free)  # the server's targets, in its order

    def free_mib(self, gpu: int, hold: bool = True) -> int:
        return self._free[gpu]

    def risk(self, gpu: int) -> Risk:
        return Risk(self._smact[gpu], 0.0, 0.0)


VIEW = View((0, 10_000, 0.5), (1, 30_000, 0.7), (2, 30_000, 0.2), (3, 5_000, 0.2))


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("magm", [1, 2, 0, 3]),  # most free first; tie 1/2 to the lower index
        ("lug", [2, 3, 0, 1]),  # least SMACT first; tie 2/3 to the lower index
        ("bf", [3, 0, 1, 2]),  # least free (all candidates already fit)
        ("ff", [0, 1, 2, 3]),
        ("exclusive", [0, 1, 2, 3]),
    ],
)
def test_policy_orders(policy, expected):
    assert POLICIES[policy]().order([0, 1, 2, 3], VIEW) == expected


def test_lug_ranks_a_gpu_of_unknown_smact_last():
    view = View((0, 1, None), (1, 1, 0.9))
    assert POLICIES["lug"]().order([0, 1], view) == [1, 0]


def test_only_exclusive_keeps_to_idle_gpus_and_only_rr_skips_the_preconditions():
    assert [name for name, make in POLICIES.items() if not make().shares] == ["exclusive"]
    assert [name for name, make in POLICIES.items() if not make().checks_fit] == ["rr"]


def test_round_robin_continues_after_the_last_gpu_placed():
    rr = POLICIES["rr"]()
    assert rr.order([0, 1, 2], VIEW) == [0, 1, 2]
    rr.placed([0])
    assert rr.order([0, 2], VIEW) == [2, 0]  # GPU 1 not a candidate
    rr.placed([2])
    assert rr.order([0, 1, 2], VIEW) == [0, 1, 2]
    rr.placed([0, 1])  # a two-GPU task moves the pointer past its last GPU
    assert rr.order([0, 1, 2], VIEW)[0] == 2


def test_round_robin_pointer_moves_only_on_placement():
    rr = POLICIES["rr"]()
    for _ in range(3):
        assert rr.order([1, 2], VIEW)[0] == 1


def test_round_robin_restarts_its_ring_when_the_last_gpu_placed_on_leaves():
    rr = POLICIES["rr"]()
    rr.placed([1])
    assert rr.order([0, 1, 2], VIEW) == [2, 0, 1]
    smaller = View((0, 1, 0.0), (2, 1, 0.0))  # GPU 1 left (a MIG instance destroyed, a node gone)
    assert rr.order([0, 2], smaller) == [0, 2]
