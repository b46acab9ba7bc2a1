"""The start-up parameter tables, rendered by `clu.parameter_overview`.

Per array: name, shape, dtype, element count and sharding (the `PartitionSpec` each array was created with).
Per module (the first `depth` levels of the parameter tree: `decoder/layers`, `vision/embed`, ...): parameters
and bytes. The per-module table goes to the console, the per-array one to the run's log file only
(`mmjax.observe.console.QUIET_ON_CONSOLE`), as it runs to dozens of lines.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
from clu import parameter_overview

log = logging.getLogger(__name__)
ARRAYS_LOGGER = f"{__name__}.arrays"  # the per-array table: log file only
arrays_log = logging.getLogger(ARRAYS_LOGGER)


@dataclasses.dataclass
class ModuleRow:
    module: str
    parameters: int
    share: str
    bytes: int


def array_table(params: Mapping[str, Any]) -> str:
    """clu's table of every array: name, shape, dtype, size and sharding; its last line is the total."""
    return parameter_overview.get_parameter_overview(dict(params), include_stats="sharding")


def module_rows(params: Mapping[str, Any], depth: int = 2) -> list[ModuleRow]:
    """Parameters and bytes per module: arrays grouped by the first `depth` parts of their path."""
    counts: dict[str, list[int]] = {}
    for name, value in parameter_overview.flatten_dict(dict(params)).items():
        module = "/".join(name.split("/")[:depth])
        n = int(np.prod(value.shape))
        entry = counts.setdefault(module, [0, 0])
        entry[0] += n
        entry[1] += n * np.dtype(value.dtype).itemsize
    total = max(sum(n for n, _ in counts.values()), 1)
    return [ModuleRow(module, n, f"{100 * n / total:.1f}%", b) for module, (n, b) in sorted(counts.items())]


def module_table(params: Mapping[str, Any], depth: int = 2) -> str:
    return parameter_overview.make_table(module_rows(params, depth),
                                         column_names=[f.name for f in dataclasses.fields(ModuleRow)])


def log_parameter_overview(params: Mapping[str, Any], note: str = "") -> None:
    """Both tables: per module at INFO on `mmjax.observe.params`, per array on its `.arrays` child."""
    log.info("parameters per module%s:\n%s", f" ({note})" if note else "", module_table(params))
    arrays_log.info("parameters per array (clu.parameter_overview):\n%s", array_table(params))
