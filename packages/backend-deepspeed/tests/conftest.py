"""Process groups for the tests.

Under torchrun the group is joined before any fixture runs, so that rank 0's
shared folders (the core plugin's `gearshift_shared_tmp`) reach every rank. In
a plain process the first engine makes a group of one; it is taken down after
each module, so tests of other packages that run later in the same process
find none.
"""

import os

import pytest
import torch.distributed as dist
from gearshift.dist import ensure_process_group

UNDER_TORCHRUN = "WORLD_SIZE" in os.environ


def pytest_configure(config):
    if UNDER_TORCHRUN:
        ensure_process_group()


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if not UNDER_TORCHRUN and dist.is_initialized():
        dist.destroy_process_group()
