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
