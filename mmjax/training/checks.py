"""The checks a training config needs beyond `Config.validate`: kernel choices that can run on this machine and a
pipeline the planner can cut. Both import what `mmjax.config` must not (the kernels, the planner), so they run
here, before anything is built: `python -m mmjax.train` exits 2 on them like on any other config error."""

from __future__ import annotations

from mmjax.config import Config
from mmjax.model.kernel_choices import check_kernel_choices
from mmjax.training.pipeline.plan import check_pipeline


def check_runnable(cfg: Config, pipeline_size: int | None = None) -> None:
    """Raise `ConfigError` naming the key if this run cannot be built; `pipeline_size` is the resolved
    `mesh.pipeline` (None: as configured, where -1 is resolved later against the devices)."""
    check_kernel_choices(cfg.model)
    stages = cfg.mesh.pipeline if pipeline_size is None else pipeline_size
    if stages > 1:
        check_pipeline(cfg, stages)
