"""`jax.profiler` traces of configured step ranges, and a summary computed from the trace itself.

`observe.profile_steps: [[first, last], ...]` traces those steps into
`<output_dir>/profile/steps_<first>-<last>/` (open it with TensorBoard's profile plugin, xprof, or
ui.perfetto.dev). On accelerators `summarize_trace` reads the `*.trace.json.gz` that jax writes and
reports, per device, over the traced window (first kernel start to last kernel end):

* `compute_share`: time at least one compute kernel runs;
* `communication_share`: time at least one collective (NCCL/all-reduce/all-gather/...) runs;
* `overlapped_share`: time both run; `nccl_overlap_pct` = overlapped / communication x 100, the share
  of communication hidden behind compute (None when the run has no collectives, e.g. one GPU);
* `memcpy_share`, `idle_share` (no kernel at all: launch gaps, host stalls);
* `top_kernels`: kernels by total time, with their category and share of the window;
* `kernel_families`: every kernel counted once in a family (`kernel_family`: cuBLAS/Triton GEMMs, each mmjax
  kernel, each kind of XLA fusion, copies, collectives), by total time: the whole window, not only the top.

Only the device's own stream lines are read (the derived "XLA Ops"/"XLA Modules" lines duplicate them).
"""

from __future__ import annotations

import gzip
import json
import logging
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

log = logging.getLogger(__name__)

COMM_PATTERN = re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|all[-_]?to[-_]?all|"
                          r"collective[-_]?permute|ragged[-_]?all|sendrecv|\bsend\b|\brecv\b", re.IGNORECASE)
MEMCPY_PATTERN = re.compile(r"memcpy|memset|memory copy|\bcopy_", re.IGNORECASE)
DEVICE_PROCESS = re.compile(r"/device:(GPU|TPU)", re.IGNORECASE)
DERIVED_LINES = ("XLA Ops", "XLA Modules", "Steps", "XLA TraceMe", "Launch Stats", "Framework Name Scope",
                 "Framework Ops", "Source code", "Host Offload Op", "TensorFlow Name Scope", "TensorFlow Ops")


def kernel_category(name: str) -> str:
    if COMM_PATTERN.search(name):
        return "communication"
    if MEMCPY_PATTERN.search(name):
        return "memcpy"
    return "compute"


GEMM_PATTERN = re.compile(r"nvjet|gemm|cublas|cutlass|xmma|matmul", re.IGNORECASE)


def kernel_family(name: str) -> str:
    """A kernel's family: 'gemm', 'memcpy', 'communication', 'mmjax:<kernel>' (the project's own kernels),
    'xla:<fusion kind>' (XLA fusions with their numbering dropped, e.g. xla:loop_broadcast_fusion) or the name
    itself with trailing numbers dropped."""
    category = kernel_category(name)
    if category != "compute":
        return category
    if name.startswith("mmjax_"):
        return "mmjax:" + name.removeprefix("mmjax_")
    if GEMM_PATTERN.search(name):
        return "gemm"
    stem = re.sub(r"(_\d+)+$|\.\d+$", "", name)
    if "fusion" in stem or stem.startswith(("wrapped_", "loop_", "input_")):
        return "xla:" + stem
    return stem


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _length(union: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in union)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize_events(events: Sequence[dict[str, Any]], steps: int = 1, top: int = 15) -> dict[str, Any]:
    """Summary of a Chrome/Perfetto trace-event list (ts/dur in microseconds). See the module docstring."""
    processes: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    device_pids = [pid for pid, name in processes.items() if DEVICE_PROCESS.search(name)]
    per_device = []
    for pid in sorted(device_pids, key=lambda p: processes[p]):
        lines = {tid: name for (p, tid), name in threads.items() if p == pid}
        streams = {tid for tid, name in lines.items() if name.startswith("Stream")}
        if not streams:  # TPU and other layouts: every line that is not a derived view
            streams = {tid for tid, name in lines.items() if not any(name.startswith(d) for d in DERIVED_LINES)}
        kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") == pid and e.get("tid") in streams
                   and float(e.get("dur", 0)) > 0]
        if kernels:
            per_device.append(_summarize_device(processes[pid], kernels, steps, top))
    summary: dict[str, Any] = {"steps": steps, "devices": per_device}
    if per_device:
        for key in ("window_ms", "step_ms", "compute_share", "communication_share", "overlapped_share",
                    "memcpy_share", "idle_share"):
            summary[key] = sum(d[key] for d in per_device) / len(per_device)
        comm = [d["nccl_overlap_pct"] for d in per_device if d["nccl_overlap_pct"] is not None]
        summary["nccl_overlap_pct"] = sum(comm) / len(comm) if comm else None
        summary["top_kernels"] = per_device[0]["top_kernels"]
        summary["kernel_families"] = per_device[0]["kernel_families"]
    return summary


def _summarize_device(name: str, kernels: list[dict[str, Any]], steps: int, top: int) -> dict[str, Any]:
    by_cat: dict[str, list[tuple[float, float]]] = defaultdict(list)
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        start, dur = float(e["ts"]), float(e["dur"])
        cat = kernel_category(str(e.get("name", "")))
        by_cat[cat].append((start, start + dur))
        entry = totals[str(e.get("name", ""))]
        entry[0] += dur
        entry[1] += 1
    compute, comm, memcpy = (_union(by_cat[c]) for c in ("compute", "communication", "memcpy"))
    begin = min(float(e["ts"]) for e in kernels)
    end = max(float(e["ts"]) + float(e["dur"]) for e in kernels)
    window = max(end - begin, 1e-9)
    busy = _length(_union(by_cat["compute"] + by_cat["communication"] + by_cat["memcpy"]))
    comm_len = _length(comm)
    overlap = _intersection(compute, comm)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    families: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for kernel, (dur, count) in totals.items():
        family = families[kernel_family(kernel)]
        family[0] += dur
        family[1] += count
    return {
        "device": name,
        "kernels": len(kernels),
        "window_ms": window / 1e3,
        "step_ms": window / 1e3 / max(steps, 1),
        "compute_share": _length(compute) / window,
        "communication_share": comm_len / window,
        "overlapped_share": overlap / window,
        "nccl_overlap_pct": 100.0 * overlap / comm_len if comm_len > 0 else None,
        "memcpy_share": _length(memcpy) / window,
        "idle_share": 1.0 - busy / window,
        "top_kernels": [{"name": k[:160], "category": kernel_category(k), "total_ms": v[0] / 1e3,
                         "count": int(v[1]), "share": v[0] / window} for k, v in ranked],
        "kernel_families": [{"family": f[:160], "total_ms": v[0] / 1e3, "count": int(v[1]), "share": v[0] / window}
                            for f, v in sorted(families.items(), key=lambda kv: -kv[1][0])],
    }


def find_trace_file(trace_dir: str | Path) -> Path | None:
    """The newest `*.trace.json.gz` jax wrote under `trace_dir` (plugins/profile/<run>/<host>.trace.json.gz)."""
    files = [p for p in Path(trace_dir).rglob("*.trace.json.gz") if p.name != "perfetto_trace.json.gz"]
    files = files or list(Path(trace_dir).rglob("perfetto_trace.json.gz"))
    return max(files, key=lambda p: p.stat().st_mtime) if files else None


def _trace_events(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


def summarize_trace(trace_dir: str | Path, steps: int = 1, top: int = 15) -> dict[str, Any]:
    path = find_trace_file(trace_dir)
    if path is None:
        return {"steps": steps, "devices": [], "error": f"no *.trace.json.gz under {trace_dir}"}
    summary = summarize_events(_trace_events(path), steps=steps, top=top)
    summary["trace_file"] = str(path)
    if not summary["devices"]:
        summary["note"] = "no device kernel events in the trace (CPU backend, or the device tracer was off)"
    return summary


def summarize_host_events(events: Sequence[dict[str, Any]], top: int = 30) -> list[dict[str, Any]]:
    """Host-side time by event name (every non-device process): what a traced compilation spent its time on.

    XLA's compiler marks its phases (`GpuCompiler::RunHloPasses`, autotuning, kernel compilation, ...); jax's
    Python tracer frames (names starting with `$`), if the trace has them, are left out. Phases nest, so totals of
    a parent include its children, and they add up over threads (XLA compiles kernels in parallel), so they can
    exceed the wall time; `count` separates one long phase from many short ones (a kernel compiled once per call
    site, say)."""
    processes = {e.get("pid"): str(e.get("args", {}).get("name", "")) for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    host = {pid for pid, name in processes.items() if not DEVICE_PROCESS.search(name)}
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        name = str(e.get("name", ""))
        if e.get("ph") == "X" and e.get("pid") in host and not name.startswith("$"):
            totals[name][0] += float(e.get("dur", 0))
            totals[name][1] += 1
    return [{"name": k[:160], "total_ms": v[0] / 1e3, "count": int(v[1])}
            for k, v in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]]


def summarize_host_trace(trace_dir: str | Path, top: int = 30) -> dict[str, Any]:
    """`summarize_host_events` of the newest trace under `trace_dir`."""
    path = find_trace_file(trace_dir)
    if path is None:
        return {"phases": [], "error": f"no *.trace.json.gz under {trace_dir}"}
    return {"phases": summarize_host_events(_trace_events(path), top=top), "trace_file": str(path)}


class Profiler:
    """Starts/stops `jax.profiler` traces around the configured step ranges; summarises each on stop."""

    def __init__(self, ranges: Sequence[Sequence[int]], out_dir: str | Path):
        self.ranges = sorted((int(a), int(b)) for a, b in ranges)
        self.out_dir = Path(out_dir)
        self.summaries: list[dict[str, Any]] = []
        self._active: tuple[int, int] | None = None

    def trace_dir(self, first: int, last: int) -> Path:
        return self.out_dir / f"steps_{first}-{last}"

    def before_step(self, step: int, state: Any) -> None:
        for first, last in self.ranges:
            if step == first and self._active is None:
                jax.block_until_ready(state)  # earlier steps' kernels stay out of the trace
                jax.profiler.start_trace(str(self.trace_dir(first, last)))
                self._active = (first, last)
                log.info("profiling steps %d-%d", first, last)

    def after_step(self, step: int, state: Any) -> dict[str, Any] | None:
        if self._active is None or step != self._active[1]:
            return None
        first, last = self._active
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        self._active = None
        directory = self.trace_dir(first, last)
        summary = {"first_step": first, "last_step": last, **summarize_trace(directory, steps=last - first + 1)}
        (directory / "summary.json").write_text(json.dumps(summary, indent=1))
        self.summaries.append(summary)
        if summary["devices"]:
            log.info("profile steps %d-%d: %.1f ms/step, compute %.1f%%, communication %.1f%%, overlapped %.1f%%, "
                     "idle %.1f%%; summary in %s", first, last, summary["step_ms"], 100 * summary["compute_share"],
                     100 * summary["communication_share"], 100 * summary["overlapped_share"],
                     100 * summary["idle_share"], directory / "summary.json")
        else:
            log.info("profile steps %d-%d written to %s (%s)", first, last, directory,
                     summary.get("note") or summary.get("error"))
        return summary

    def close(self) -> None:
        if self._active is not None:  # a run that ended inside a range still leaves a readable trace
            jax.profiler.stop_trace()
            self._active = None
