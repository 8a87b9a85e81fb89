"""The process group `ensure_process_group` makes in a plain process."""

import subprocess
import sys

CHILD = """
import atexit
import torch.distributed as dist
atexit.register(lambda: print("group at exit:", dist.is_initialized()))  # runs after those registered later
from gearshift.dist import ensure_process_group
ensure_process_group("cpu")
print("group made:", dist.is_initialized(), dist.get_world_size())
"""


def test_a_group_of_one_made_for_the_engines_is_taken_down_at_exit():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "group made: True 1" in out.stdout
    assert "group at exit: False" in out.stdout  # destroyed, so no "destroy_process_group() was not called"
