"""A test folder's name says how long its tests take (tests/support/tiers.py): a test with no slower marker in
tests/multirank, tests/notebooks or tests/system is refused when collected, so `make test-fast` never runs it from a
folder that says otherwise."""

from pathlib import Path
from types import SimpleNamespace

import pytest

import tiers


@pytest.mark.parametrize(("path", "slow"), [("multirank/test_x.py", True), ("notebooks/test_x.py", True),
                                            ("system/sub/test_x.py", True), ("unit/test_x.py", False),
                                            ("gpu/test_x.py", False)])
def test_the_folders_of_slow_tests_are_told_apart(path, slow):
    assert tiers.in_a_slow_folder(tiers.TESTS / path) is slow
    assert not tiers.in_a_slow_folder(tiers.TESTS.parent / "notebooks" / "00_setup.ipynb")  # nbmake's items


class _Item(SimpleNamespace):
    """What conftest's collection hook reads of a collected test."""

    def get_closest_marker(self, name):
        return name if name in self.markers else None

    def add_marker(self, marker):
        self.markers.append(marker.name)


def test_a_unit_test_planted_in_a_slow_folder_is_refused_at_collection(request):
    """The rule as the root conftest.py (the one this run loaded) applies it, on a planted item."""
    conftest = next(p for p in request.config.pluginmanager.get_plugins()
                    if Path(getattr(p, "__file__", "") or "/") == tiers.TESTS.parent / "conftest.py")
    planted = _Item(path=tiers.TESTS / "multirank" / "test_planted.py", nodeid="tests/multirank/test_planted.py::t",
                    markers=[], fixturenames=())
    with pytest.raises(pytest.UsageError, match="is a unit test .* move it to tests/unit/"):
        conftest.pytest_collection_modifyitems(None, [planted])
    marked = _Item(path=planted.path, nodeid=planted.nodeid, markers=["multirank"], fixturenames=())
    fast = _Item(path=tiers.TESTS / "unit" / "test_fast.py", nodeid="tests/unit/test_fast.py::t", markers=[],
                 fixturenames=())
    conftest.pytest_collection_modifyitems(None, [marked, fast])
    assert marked.markers == ["multirank"] and fast.markers == ["unit"]
