"""Which source lines each XLA kernel of a compiled program comes from, read from its optimized HLO text.

A profile names XLA's kernels after their fusion instructions (`loop_reduce_fusion_30` is the instruction
`%loop_reduce_fusion.30`), which says what kind of kernel ran but not which model code made it. The optimized HLO
(`compiled.as_text()`, or the `*after_optimizations.txt` files of `XLA_FLAGS=--xla_dump_to=DIR
--xla_dump_hlo_as_text`) carries, for every instruction inside a fusion, the jax op it came from and its source
location (`metadata={op_name=... stack_frame_id=N}` with the module's frame tables, or `source_file=...
source_line=...` in older dumps). `kernel_sources` joins the two: per kernel, the ops and lines fused into it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_CALLS = re.compile(r"\bcalls=%(?P<callee>[\w.\-]+)")
_OP_NAME = re.compile(r'op_name="(?P<op_name>[^"]*)"')
_FRAME_ID = re.compile(r"\bstack_frame_id=(?P<id>\d+)")
_SOURCE = re.compile(r'source_file="(?P<file>[^"]*)"\s+source_line=(?P<line>\d+)')
_TABLE_ROW = re.compile(r"^(?P<id>\d+)\s+(?P<body>.*)$")
_FIELD = re.compile(r"(\w+)=(\d+)")


@dataclass
class Fusion:
    """A fusion instruction of a non-fused computation: the kernel XLA emits for it, and what it holds."""

    instruction: str                                    # HLO name, e.g. loop_reduce_fusion.30
    kernel: str                                         # the profile's name, e.g. loop_reduce_fusion_30
    op_names: Counter = field(default_factory=Counter)  # jax ops fused in (op_name's last part), by count
    sources: Counter = field(default_factory=Counter)   # "file:line (function)" of those ops, by count


    def described(self) -> dict:
        """Its most frequent fused ops and source lines, as a report row gives them."""
        return {"ops": [op for op, _ in self.op_names.most_common(6)],
                "sources": [src for src, _ in self.sources.most_common(3)]}


def kernel_name(instruction: str) -> str:
    """The name a GPU profile gives the kernel of an HLO fusion instruction (dots become underscores)."""
    return instruction.replace(".", "_")


def _frame_tables(lines: list[str]) -> dict[int, str]:
    """stack_frame_id -> "file:line (function)" of its innermost frame, from the module's frame tables (the
    sections before the first computation)."""
    tables: dict[str, dict[int, str]] = {}
    section = None
    for line in lines:
        stripped = line.strip()
        if stripped.startswith(("%", "ENTRY")):
            break
        if stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = tables.setdefault(stripped, {})
        elif not stripped:
            section = None
        elif section is not None and (row := _TABLE_ROW.match(stripped)):
            section[int(row["id"])] = row["body"]
    files = {i: body.strip('"') for i, body in tables.get("FileNames", {}).items()}
    functions = {i: body.strip('"') for i, body in tables.get("FunctionNames", {}).items()}
    locations = {}
    for i, body in tables.get("FileLocations", {}).items():
        f = dict((k, int(v)) for k, v in _FIELD.findall(body))
        locations[i] = (f"{files.get(f.get('file_name_id'), '?')}:{f.get('line', '?')} "
                        f"({functions.get(f.get('function_name_id'), '?')})")
    frames = {}
    for i, body in tables.get("StackFrames", {}).items():
        f = dict((k, int(v)) for k, v in _FIELD.findall(body))
        frames[i] = locations.get(f.get("file_location_id"), "?")
    return frames


def _source(metadata: str, frames: dict[int, str]) -> str | None:
    match = _FRAME_ID.search(metadata)
    if match:
        return frames.get(int(match["id"]))
    match = _SOURCE.search(metadata)
    return f"{match['file']}:{match['line']}" if match else None


def fusion_sources(hlo_text: str) -> dict[str, Fusion]:
    """Every fusion instruction outside fused computations, keyed by its profile kernel name, with the jax ops
    and source locations of the instructions its fused computation holds."""
    lines = hlo_text.splitlines()
    frames = _frame_tables(lines)
    bodies: dict[str, list[tuple[str, str]]] = {}   # computation -> [(instruction name, rest of its line)]
    current = None
    for line in lines:
        head = _COMPUTATION.match(line)
        if head:
            current = head["name"]
            bodies[current] = []
            continue
        if line.strip() == "}":
            current = None
            continue
        inst = _INSTRUCTION.match(line) if current else None
        if inst:
            bodies[current].append((inst["name"], inst["rest"]))
    fused = {callee for body in bodies.values() for _, rest in body if " fusion(" in rest
             for callee in _CALLS.findall(rest)}
    result: dict[str, Fusion] = {}
    for computation, body in bodies.items():
        if computation in fused:
            continue
        for name, rest in body:
            calls = _CALLS.search(rest)
            if " fusion(" not in rest or calls is None:
                continue
            entry = Fusion(name, kernel_name(name))
            for _, inner in bodies.get(calls["callee"], []):
                op_name = _OP_NAME.search(inner)
                if not op_name:
                    continue
                entry.op_names[op_name["op_name"].rsplit("/", 1)[-1]] += 1
                where = _source(inner, frames)
                if where:
                    entry.sources[where] += 1
            result[entry.kernel] = entry
    return result


def kernel_sources(top_kernels: list[dict], fusions: dict[str, Fusion], steps: int = 1) -> list[dict]:
    """The profile's kernels (`observe.profile` top_kernels rows: name, total_ms, count) with, for XLA fusions,
    the ops and source lines fused into each; per step (of `steps`) times and counts."""
    rows = []
    for k in top_kernels:
        fusion = fusions.get(k["name"])
        rows.append({"kernel": k["name"], "ms_per_step": k["total_ms"] / steps, "per_step": k["count"] / steps,
                     **(fusion.described() if fusion else {"ops": [], "sources": []})})
    return rows
