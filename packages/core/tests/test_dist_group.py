"""The process groups gearshift makes or joins, and how a process that holds one ends."""

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


JOINED = """
import atexit, os, sys
import torch.distributed as dist
atexit.register(lambda: print("group at exit:", dist.is_initialized()))
from gearshift import cli, dist as gdist
gdist.init()  # as torchrun's ranks join, here a world of one
print("joined:", dist.is_initialized())
code = cli.main(sys.argv[1:])
print("code:", code)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env() -> dict[str, str]:
    """The variables torchrun gives a rank, for a world of one."""
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()), "PATH": "/usr/bin:/bin"}


def _joined(*argv: str) -> str:
    out = subprocess.run([sys.executable, "-c", JOINED, *argv], capture_output=True, text=True, timeout=120,
                         env=_rank_env())
    assert out.returncode == 0, out.stderr[-2000:]
    assert "joined: True" in out.stdout
    return out.stdout


def test_a_command_that_ends_well_takes_down_the_group_its_ranks_joined():
    """Else gloo's threads can abort a rank at the interpreter's exit after a good run."""
    stdout = _joined("env")
    assert "code: 0" in stdout and "group at exit: False" in stdout


def test_a_command_that_fails_leaves_the_group_alone():
    """Taking a group down while a peer may still be inside a collective can hang: not on failure."""
    stdout = _joined("backends", "no-such-backend")
    assert "code: 0" not in stdout and "group at exit: True" in stdout


RANK = """
import atexit, sys
class Teardown:
    def __del__(self):
        print("interpreter teardown", flush=True)
keep = Teardown()
atexit.register(lambda: print("exit handlers ran", flush=True))
from gearshift import cli, dist as gdist
gdist.init()  # as torchrun's ranks join, here a world of one
sys.argv = ["gearshift", *sys.argv[1:]]
cli.run()
"""


def _rank(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RANK, *argv], capture_output=True, text=True, timeout=120,
                          env=_rank_env())


def test_a_rank_that_ended_well_exits_without_the_interpreters_teardown():
    """gloo's worker threads outlive `destroy_process_group` while an FSDP module's mesh holds the group; one
    that drops its last work during the teardown needs the GIL and aborts the rank (exit -6 after a good run)."""
    out = _rank("env")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "exit handlers ran" in out.stdout and "python" in out.stdout  # `env`'s own output came out whole
    assert "interpreter teardown" not in out.stdout


def test_a_rank_whose_command_failed_exits_the_usual_way():
    out = _rank("backends", "no-such-backend")
    assert out.returncode != 0
    assert "exit handlers ran" in out.stdout and "interpreter teardown" in out.stdout


GRACE = """
import atexit, threading, time
ticks, end = [], []
# registered first, so it runs last of the exit handlers, just before the teardown
atexit.register(lambda: print("other threads ran during the exit handlers:", len(ticks) - end[0], flush=True))
from gearshift import dist as gdist
def tick():  # stands for a gloo worker that still has a finished work to drop: it needs the GIL for that
    while True:
        ticks.append(1)
        time.sleep(0.005)
gdist.init()  # as torchrun's ranks join, here a world of one
threading.Thread(target=tick, daemon=True).start()
time.sleep(0.05)
end.append(len(ticks))  # the script's last line
"""


def test_a_rank_ended_by_the_interpreters_teardown_lets_other_threads_finish_first():
    """A rank that ends the usual way (a script of the user's own, the suite under torchrun) gives the GIL to
    other threads before the teardown, which hands it to none: a gloo worker that drops a finished work there
    aborts the rank (seen in 2 of 40 two-rank runs of an FSDP step under load, 0 of 40 after)."""
    out = subprocess.run([sys.executable, "-c", GRACE], capture_output=True, text=True, timeout=120,
                         env=_rank_env())
    assert out.returncode == 0, out.stderr[-2000:]
    ran = int(out.stdout.split("exit handlers:")[1])
    assert ran >= 10, out.stdout  # the thread ticks every 5 ms: the exit holds for EXIT_GRACE_S (0.25 s)
