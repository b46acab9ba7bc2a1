"""TPU device grids ordered by the physical topology (the ICI torus), for `mesh.make_mesh`.

`jax.devices()` lists TPU devices in an order unrelated to the torus; reshaping that list into the mesh can
put the devices of one tensor-parallel group far apart on the interconnect. `mesh_utils.create_device_mesh`
assigns mesh axes to physical axes (innermost mesh axis, `tensor`, onto the closest devices). Several slices
(a multi-slice job, connected by DCN) need `create_hybrid_device_mesh` instead, which `mesh.hybrid_grid`
uses when `mesh.dcn_data` / `mesh.dcn_fsdp` say how many slices the batch axes span.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.experimental import mesh_utils

from mmjax.errors import ConfigError

log = logging.getLogger(__name__)


def is_tpu(devices: Sequence[Any]) -> bool:
    return bool(devices) and getattr(devices[0], "platform", None) == "tpu"


def num_slices(devices: Sequence[Any]) -> int:
    return len({getattr(d, "slice_index", 0) for d in devices})


def tpu_grid(shape: Sequence[int], devices: Sequence[Any]) -> np.ndarray:
    """The devices of one TPU slice as an array of `shape`, neighbouring on the torus along the inner axes.

    A shape that cannot be laid onto whole physical axes (e.g. a tensor axis of 3 on a 2x2x2 slice) is laid
    out splitting physical axes (`allow_split_physical_axes`), which keeps correctness but may cost bandwidth.
    """
    n = num_slices(devices)
    if n > 1:
        raise ConfigError(
            f"the {len(devices)} TPU devices span {n} slices: set mesh.dcn_data (or mesh.dcn_fsdp) so that they "
            f"multiply to {n}, so that only a batch axis crosses the slow links between slices")
    try:
        return mesh_utils.create_device_mesh(tuple(shape), list(devices))
    except (ValueError, NotImplementedError, AssertionError) as e:
        log.warning("mesh %s does not map onto whole physical TPU axes (%s); splitting physical axes", shape, e)
        return mesh_utils.create_device_mesh(tuple(shape), list(devices), allow_split_physical_axes=True)
