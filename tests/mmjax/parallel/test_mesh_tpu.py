"""TPU device grids follow the physical torus: checked with device records carrying TPU v4 coordinates (no TPU
here; `mesh_utils` reads only their attributes), listed in a shuffled order as `jax.devices()` may."""

import dataclasses
import random

import numpy as np
import pytest

from mmjax.errors import ConfigError
from mmjax.parallel.mesh_tpu import is_tpu, tpu_grid


@dataclasses.dataclass(frozen=True)
class TpuDevice:
    id: int
    coords: tuple[int, int, int]
    slice_index: int = 0
    core_on_chip: int = 0
    process_index: int = 0
    platform: str = "tpu"
    device_kind: str = "TPU v4"


def slice_2x2x2(slice_index=0, start=0):
    devices = [TpuDevice(start + i, (x, y, z), slice_index) for i, (z, y, x) in enumerate(np.ndindex(2, 2, 2))]
    random.Random(slice_index).shuffle(devices)
    return devices


def test_tensor_groups_are_physical_planes():
    devices = slice_2x2x2()
    assert is_tpu(devices)
    grid = tpu_grid((2, 1, 1, 1, 4), devices)  # data=2, tensor=4
    assert sorted(d.id for d in grid.flat) == list(range(8))
    for row in grid.reshape(2, 4):  # each tensor group: the 4 chips of one z-plane (a 2x2 ring of neighbours)
        assert len({d.coords[2] for d in row}) == 1
    # an axis size that is no whole physical axis still gets every device once
    assert sorted(d.id for d in tpu_grid((1, 1, 1, 1, 8), devices).flat) == list(range(8))


def test_several_slices_need_dcn_axes():
    devices = slice_2x2x2(0) + slice_2x2x2(1, start=8)
    with pytest.raises(ConfigError, match="span 2 slices: set mesh.dcn_data"):
        tpu_grid((2, 1, 1, 1, 8), devices)


def test_two_slices_split_the_data_axis_over_dcn():
    from mmjax.parallel.mesh import hybrid_grid

    devices = slice_2x2x2(0) + slice_2x2x2(1, start=8)
    sizes = {"data": 2, "fsdp": 2, "pipeline": 1, "sequence": 1, "tensor": 4}
    grid = hybrid_grid(sizes, {"data": 2, "fsdp": 1, "pipeline": 1, "sequence": 1, "tensor": 1}, devices)
    assert grid.shape == (2, 2, 1, 1, 4)
    assert [{d.slice_index for d in grid[i].flat} for i in range(2)] == [{0}, {1}]  # one slice per data index
    for group in grid.reshape(4, 4):
        assert len({d.coords[2] for d in group}) == 1


def test_axes_that_need_split_physical_axes_still_get_a_grid(caplog):
    devices = [TpuDevice(i, (x, y, z)) for i, (z, y, x) in enumerate(np.ndindex(4, 4, 4))]  # a 4x4x4 v4 slice
    grid = tpu_grid((8, 1, 1, 1, 8), devices)  # tensor=8 is no whole physical axis of 4
    assert grid.shape == (8, 1, 1, 1, 8) and sorted(d.id for d in grid.flat) == list(range(64))
    assert "splitting physical axes" in caplog.text
