import pytest
import torch

from gearshift.mesh import MeshError, MeshSpec, Placement


def test_world_size_and_validation():
    m = MeshSpec(dp=4, tp=2)
    assert m.world_size == 8
    assert m.validate(8) is m
    with pytest.raises(MeshError, match="spans 8 ranks but the world has 4"):
        m.validate(4)
    with pytest.raises(MeshError, match="whole numbers"):
        MeshSpec(dp=0)


def test_parse():
    assert MeshSpec.parse("dp=4,tp=2") == MeshSpec(dp=4, tp=2)
    assert MeshSpec.parse("") == MeshSpec()
    with pytest.raises(MeshError, match="dp=4,tp=2"):
        MeshSpec.parse("dp4")
    with pytest.raises(MeshError):
        MeshSpec.parse("xx=2")


def test_rank_coordinates_tp_innermost():
    m = MeshSpec(dp=2, tp=2, pp=2)
    assert m.coords(0) == {"pp": 0, "dp": 0, "sp": 0, "tp": 0}
    assert m.coords(1) == {"pp": 0, "dp": 0, "sp": 0, "tp": 1}
    assert m.coords(2) == {"pp": 0, "dp": 1, "sp": 0, "tp": 0}
    assert m.coords(4)["pp"] == 1
    for r in range(m.world_size):
        assert m.rank_of(**m.coords(r)) == r
    assert m.group(3, "tp") == [2, 3]
    assert m.group(3, "dp") == [1, 3]
    with pytest.raises(MeshError, match="outside"):
        m.coords(8)


def test_placement_matches_torch_chunk():
    m = MeshSpec(dp=4)
    p = Placement.of(m, {"dp": 0})
    full = torch.arange(10 * 3).reshape(10, 3)
    chunks = torch.chunk(full, 4, dim=0)
    for r in range(4):
        box = p.local_box((10, 3), r)
        got = full[box[0][0]:box[0][1]]
        assert torch.equal(got, chunks[r]) if r < len(chunks) else got.numel() == 0


def test_nested_placement_over_two_axes():
    m = MeshSpec(dp=2, tp=2)
    p = Placement.of(m, {"dp": 0, "tp": 0})  # dp outer, tp inner: 4 disjoint row blocks
    boxes = [p.local_box((8, 2), r) for r in range(4)]
    assert [b[0] for b in boxes] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(MeshError, match="dim 2"):
        Placement.of(m, {"tp": 2}).local_box((4, 4), 0)


def test_device_mesh_conversion_single_process():
    import os

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        dm = MeshSpec().to_device_mesh("cpu")
        assert dm.mesh_dim_names == ("dp",)
        with pytest.raises(MeshError, match="must be in the device mesh"):
            MeshSpec(dp=2).to_device_mesh("cpu", axes=("tp",))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
