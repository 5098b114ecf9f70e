"""Fixtures shared by the transfer tests. A module using them defines LAYOUT, CFG and SRC_SEED."""

import pytest

from tests.support.transport import Remote, fill_random


@pytest.fixture(scope="module")
def rx(request):
    """A ZmqReceiver for the module's LAYOUT and CFG in its own process, shared by the module's tests
    (each uses its own transfer ids)."""
    with Remote("receiver", request.module.LAYOUT, request.module.CFG) as remote:
        yield remote


@pytest.fixture(scope="module")
def src(request):
    """The sender's memory: the module's LAYOUT filled from SRC_SEED."""
    return fill_random(request.module.LAYOUT, seed=request.module.SRC_SEED)
