"""Two processes x 4 CPU devices through jax.distributed give one process x 8 devices' losses.

The two-process run builds the hybrid mesh (`mesh.dcn_data=2`: the data axis spans the processes,
fsdp x tensor stay inside each), as a two-node GPU run would. Both processes run the CLI with LLVM at -O0:
compiling is most of this test's time, and -O0 compiles faster. The one-process reference runs the CLI's entry
point (`mmjax.train.main`) in this process, which has the 8 CPU devices and compiles at -O0 as well
(tests/conftest.py): a third process would only add its start-up.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from mmjax.train import main

REPO = Path(__file__).resolve().parents[3]
RUN = ["model.text.n_layers=1", "model.vision.n_layers=1", "data.num_train=256", "data.num_eval=16",
       "data.num_shards=2", "eval.num_examples=16", "eval.batch_size=16", "train.global_batch_size=16",
       "train.steps=3", "observe.log_every=1", "observe.sinks=[jsonl]", "eval.every_steps=0",
       "model.compute_dtype=float32", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
       # each process gets its own output_dir here; Orbax's multi-process save needs one shared folder
       "checkpoint.enabled=false"]


# LLVM -O0, as in tests/mmjax/test_notebook.py (checked: the same losses and answers as the default level)
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_two_processes_match_one_process(tmp_path):
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}",
               JAX_PLATFORMS="cpu", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    # 1 x 8 devices, in this process (it also writes the data cache that both processes then read)
    assert len(jax.devices()) == 8
    assert main([*RUN, cache, f"train.output_dir={tmp_path / 'single'}"]) == 0
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "mmjax.train", *RUN, cache, f"train.output_dir={tmp_path / f'p{i}'}",
         f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
         f"distributed.process_id={i}", "mesh.dcn_data=2"], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=400)
        finally:
            p.kill()
        logs.append(out)
        assert p.returncode == 0, out[-3000:]
    want = losses(tmp_path / "single")
    assert len(want) == 3
    for i, log in enumerate(logs):
        assert f"process {i} of 2, 4 local / 8 global devices" in log
        assert f"process {i} of 2 loads 8 rows of each global batch" in log  # half of the 16-row batch
    # the losses are global values; only the main process writes metrics
    np.testing.assert_allclose(losses(tmp_path / "p0"), want, rtol=1e-5)
    assert not (tmp_path / "p1" / "metrics.jsonl").exists()
    # the final evaluation ran through the serving engine on both processes in lockstep; process 0 wrote
    # the answers, those of the one-process run
    answers = lambda run: [json.loads(line)["prediction"] for line in
                           (run / "eval" / "step_0000003.jsonl").read_text().splitlines()]
    assert len(answers(tmp_path / "single")) == 16
    assert answers(tmp_path / "p0") == answers(tmp_path / "single")
