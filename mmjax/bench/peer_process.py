"""Run a peer benchmark (torch, Hugging Face) in its own process and read back its one-line JSON result.

A separate process because JAX preallocates most of the GPU's memory in the process that first touches it; the
peer runs first and exits, so both sides get the whole device.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any


def run_peer_process(module: str, args: dict, result_prefix: str, timeout_s: float = 1800) -> dict:
    """`python -m <module> '<args as JSON>'`; the JSON after `result_prefix` on its stdout, or {"skipped": why}."""
    try:
        proc = subprocess.run([sys.executable, "-m", module, json.dumps(args)], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"skipped": f"timed out after {timeout_s:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(result_prefix):
            return json.loads(line[len(result_prefix):])
    return {"skipped": f"failed (exit {proc.returncode}): {proc.stderr.strip()[-600:]}"}


def torch_and_device(allow_cpu: bool, cpu_flag: str) -> tuple[Any, Any, str] | dict:
    """(torch, transformers, "cuda" | "cpu") for a peer process, or {"skipped": why} where it cannot run:
    torch or transformers missing, or no CUDA device and `allow_cpu` false (`cpu_flag` names the option)."""
    try:
        import torch
        import transformers
    except ImportError as e:
        return {"skipped": f"torch/transformers not installed ({e})"}
    if torch.cuda.is_available():
        return torch, transformers, "cuda"
    if allow_cpu:
        return torch, transformers, "cpu"
    return {"skipped": f"no CUDA device for torch; {cpu_flag} runs the peer on the CPU (tiny models only)"}


def peer_main(run: Callable[..., dict], result_prefix: str, argv: list[str] | None = None) -> int:
    """A peer module's entry point: `run(**<the JSON argument>)`, printed as one `result_prefix` line."""
    args = json.loads((sys.argv[1:] if argv is None else argv)[0])
    print(result_prefix + json.dumps(run(**args)), flush=True)
    return 0
