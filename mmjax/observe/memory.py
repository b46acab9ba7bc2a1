"""Device memory of compiled steps: refuse a batch shape that cannot fit before training starts, and turn an
out-of-memory failure in the loop into an error that says what to change.

Why: XLA compiles every bucket's train step at start-up, but a step too large for the device only fails when
it first runs, possibly many steps (and minutes) later, as a runtime error deep in a host transfer. The
compiled executable already knows what it needs (`memory_analysis`); the allocator knows the device's limit.
"""

from __future__ import annotations

from typing import Any

import jax

from mmjax.errors import DeviceMemoryError

ADVICE = ("lower train.global_batch_size (raising train.grad_accum_steps keeps the batch), set model.remat "
          "(full, or dots), or shorten the rows (model.max_seq_len, data.buckets)")
GIB = 2**30


def is_device_oom(e: BaseException) -> bool:
    """Whether `e` is XLA's out-of-memory failure (RESOURCE_EXHAUSTED from the allocator)."""
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def device_memory_limit(device: Any = None) -> int | None:
    """Bytes the allocator may hand out on `device` (default: the first local one); None where the platform
    does not say (the CPU)."""
    device = jax.local_devices()[0] if device is None else device
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a platform without memory statistics
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def compiled_bytes(compiled: Any) -> int | None:
    """Device bytes a compiled executable needs while it runs: arguments and outputs (less the donated
    arguments its outputs reuse) and its temporaries; None where the backend gives no analysis."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


def check_fits(compiled: Any, what: str, limit: int | None) -> None:
    """Raise `DeviceMemoryError` naming `what` (e.g. the batch shape) if `compiled` needs more than `limit`
    bytes per device. No limit or no analysis: nothing to check."""
    need = compiled_bytes(compiled)
    if limit is None or need is None or need <= limit:
        return
    raise DeviceMemoryError(f"the train step for {what} needs {need / GIB:.1f} GiB of device memory per device, "
                            f"more than the {limit / GIB:.1f} GiB the device allows; {ADVICE}")


def oom_error(e: BaseException, what: str) -> DeviceMemoryError:
    """The error to raise for an out-of-memory failure `e` while running `what`."""
    first = " ".join(str(e).split())[:300]
    return DeviceMemoryError(f"the device ran out of memory in {what} ({first}); {ADVICE}")
