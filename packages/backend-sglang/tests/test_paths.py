"""SGLang's sockets go in its temporary folder, whose path must leave room for their names (AF_UNIX: 107 bytes)."""

import shutil
import socket
import tempfile
from pathlib import Path

from gearshift_sglang.host import MAX_SOCKET_DIR, temp_dir


def test_a_short_cache_folder_keeps_its_temporary_folder_inside():
    root = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))  # pytest's own folders can be longer than the limit
    try:
        assert temp_dir(root) == (root / "tmp").resolve()
    finally:
        shutil.rmtree(root)


def test_a_long_cache_folder_gets_a_short_temporary_folder_where_a_socket_binds(tmp_path):
    root = tmp_path / ("deep" * 30) / "cache"
    tmp = temp_dir(root)
    assert len(str(tmp)) <= MAX_SOCKET_DIR and tmp.is_dir() and temp_dir(root) == tmp
    # what multiprocessing's resource sharer makes there: a listener socket two levels down
    (tmp / "pymp-abcdefgh").mkdir(exist_ok=True)
    path = tmp / "pymp-abcdefgh" / "listener-abcdefgh"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
    path.unlink()
    (tmp / "pymp-abcdefgh").rmdir()
