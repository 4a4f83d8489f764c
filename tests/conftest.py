"""Fixtures; the helpers the test modules share are in tests/helpers.py."""
import os

import pytest
import torch

from posbench.encodings import REGISTRY

torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)  # xdist: one thread per worker


@pytest.fixture(params=sorted(REGISTRY))
def encoding_name(request):
    return request.param
