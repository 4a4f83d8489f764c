"""Fixtures; the helpers the test modules share are in tests/helpers.py."""
import os

import pytest
import torch

from posbench.encodings import REGISTRY

torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)  # xdist: one thread per worker


@pytest.fixture(params=sorted(REGISTRY))
def encoding_name(request):
    return request.param


FAILURE_LOG = os.environ.get("POSBENCH_FAILURE_LOG")  # a file each failure is appended to as it happens


def pytest_runtest_logreport(report):
    """With POSBENCH_FAILURE_LOG set, each failed test's report goes to that file at once, not in the summary at
    the end: a device call whose time runs out mid-suite keeps why its failures failed."""
    if FAILURE_LOG and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(FAILURE_LOG, "a") as log:
            log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


SLOW_LEFT_OUT = pytest.StashKey[int]()  # slow tests the default -m 'not slow' deselected in this process


def pytest_deselected(items):
    if items:
        stash = items[0].config.stash
        stash[SLOW_LEFT_OUT] = stash.get(SLOW_LEFT_OUT, 0) + sum(1 for item in items if item.get_closest_marker("slow"))


def pytest_sessionfinish(session):
    """A pytest-xdist worker tells the controller how many slow tests it deselected."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["slow_left_out"] = session.config.stash.get(SLOW_LEFT_OUT, 0)


def pytest_testnodedown(node, error):
    """The controller's count: every worker collects the whole suite, so each deselects the same tests."""
    left_out = getattr(node, "workeroutput", {}).get("slow_left_out", 0)
    node.config.stash[SLOW_LEFT_OUT] = max(node.config.stash.get(SLOW_LEFT_OUT, 0), left_out)


def pytest_terminal_summary(terminalreporter, config):
    """Where pyproject's default `-m 'not slow'` left tests out, how to run them."""
    left_out = config.stash.get(SLOW_LEFT_OUT, 0)
    if left_out and config.option.markexpr == "not slow":
        terminalreporter.write_line(f"{left_out} slow checks left out (marked slow): python -m pytest -m slow runs "
                                    "them, -m '' runs everything")
