"""tools/gpu/rechunk.sh: a carry's chunks split again into smaller parts, the same bytes in the same order."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu" / "rechunk.sh"


def make_carry(root: Path, data: bytes, part: int) -> Path:
    carry = root / ".carry"
    (carry / "dev").mkdir(parents=True)
    sums = []
    for i in range(0, len(data), part):
        name = f"part.{i // part:02d}"
        d = carry / f"c{i // part + 1:02d}"
        d.mkdir()
        (d / name).write_bytes(data[i:i + part])
        sums.append(f"{hashlib.sha256(data[i:i + part]).hexdigest()}  {name}")
    (carry / "dev" / "parts.sha256").write_text("\n".join(sums) + "\n")
    (carry / "dev" / "install.sh").write_text("echo kept\n")
    return carry


def test_parts_are_split_smaller_and_keep_the_bytes_and_their_sums(tmp_path):
    data = os.urandom(11 * 1024 + 17)
    carry = make_carry(tmp_path, data, 4096)  # three chunks of at most 4 KiB
    done = subprocess.run(["bash", str(SCRIPT), str(carry), "3k"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    chunks = sorted(p for p in carry.iterdir() if p.name.startswith("c"))
    assert [c.name for c in chunks] == ["c01", "c02", "c03", "c04"]  # 11 KiB + 17 bytes in parts of 3 KiB
    parts = [next(c.iterdir()) for c in chunks]
    assert [p.name for p in parts] == ["part.00", "part.01", "part.02", "part.03"]
    assert all(p.stat().st_size <= 3 * 1024 for p in parts)
    assert b"".join(p.read_bytes() for p in parts) == data
    sums = (carry / "dev" / "parts.sha256").read_text().split("\n")
    assert sums[:4] == [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in parts]
    assert (carry / "dev" / "install.sh").read_text() == "echo kept\n"
    assert not (carry / "stage").exists()


def test_ten_or_more_chunks_keep_their_order(tmp_path):
    data = os.urandom(12 * 1000)
    carry = make_carry(tmp_path, data, 6000)
    done = subprocess.run(["bash", str(SCRIPT), str(carry), "1000"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    chunks = sorted(p for p in carry.iterdir() if p.name.startswith("c"))
    assert len(chunks) == 12
    # split again from twelve parts: c10 .. c12 sort after c09, and the bytes come back in order
    done = subprocess.run(["bash", str(SCRIPT), str(carry), "5000"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    parts = [next(c.iterdir()) for c in sorted(p for p in carry.iterdir() if p.name.startswith("c"))]
    assert b"".join(p.read_bytes() for p in parts) == data


def test_a_stream_on_standard_input_is_chunked_as_make_chunks_does(tmp_path):
    data = os.urandom(7 * 1000 + 3)
    carry = tmp_path / ".carry-sglang"
    done = subprocess.run(["bash", str(SCRIPT), str(carry), "2000", "-"], input=data, capture_output=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    parts = [next(c.iterdir()) for c in sorted(p for p in carry.iterdir() if p.name.startswith("c"))]
    assert [p.parent.name for p in parts] == ["c01", "c02", "c03", "c04"]
    assert b"".join(p.read_bytes() for p in parts) == data
    sums = (carry / "dev" / "parts.sha256").read_text().split("\n")
    assert sums[:4] == [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in parts]
