"""The suite's scheduler hands a waiting test to a worker beside a busy one, and a busy one beside a
waiting one."""

from __future__ import annotations

from collections import OrderedDict

from tests.support.pairing import pick

WAITING = ("tests/e2e/test_averager.py",)


def queue(*nodeids: str) -> OrderedDict[str, dict[str, bool]]:
    return OrderedDict((nodeid, {nodeid: False}) for nodeid in nodeids)


def test_the_other_kind_first_else_the_queues_head():
    q = queue("tests/e2e/test_galaxy.py::a", "tests/e2e/test_galaxy.py::b", "tests/e2e/test_averager.py::c")
    assert pick(q, other_waits=False, waiting=WAITING) == "tests/e2e/test_averager.py::c"
    assert pick(q, other_waits=True, waiting=WAITING) == "tests/e2e/test_galaxy.py::a"
    assert pick(q, other_waits=None, waiting=WAITING) == "tests/e2e/test_galaxy.py::a"
    only_busy = queue("tests/e2e/test_galaxy.py::a", "tests/dist/test_logs.py::b")
    assert pick(only_busy, other_waits=False, waiting=WAITING) == "tests/e2e/test_galaxy.py::a"


def test_a_group_is_judged_by_its_first_test():
    q = queue("tests/e2e/test_galaxy.py::a")
    q["wan"] = {"tests/e2e/test_averager.py::x@wan": False, "tests/e2e/test_averager.py::y@wan": False}
    assert pick(q, other_waits=False, waiting=WAITING) == "wan"
