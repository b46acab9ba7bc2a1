"""deploy/ without a cluster: the SLURM script's training command (the script itself, run with `srun` standing in
as a plain launcher) and the JobSet's container command resolve with --print-config into the settings they
promise; the manifest parses and its process count, indices and coordinator agree; the image installs what the
README installs, as a non-root user, with the compilation cache on a volume."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MMJAX_")) and k != "JAX_COMPILATION_CACHE_DIR"}
    return dict(env, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), **extra)


def _print_config(cmd: list[str], **env: str) -> dict:
    proc = subprocess.run(cmd, cwd=REPO, env=_env(**env), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, \
        f"{shlex.join(cmd)}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    start = proc.stdout.index("model:")  # after the script's own first line
    return yaml.safe_load(proc.stdout[start:])


def sbatch_options(path: Path) -> dict[str, str]:
    opts = {}
    for line in path.read_text().splitlines():
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if m:
            opts[m.group(1)] = m.group(2) or ""
    return opts


def test_sbatch_runs_one_process_per_gpu_and_requeues_with_resume(tmp_path):
    script = DEPLOY / "slurm" / "train.sbatch"
    opts = sbatch_options(script)
    assert opts["ntasks-per-node"] == opts["gpus-per-node"]  # one process per GPU
    assert "requeue" in opts and re.fullmatch(r"B:USR1@\d+", opts["signal"]) and opts["open-mode"] == "append"
    # srun stands in as a plain launcher: it drops its own options and runs the command, here with --print-config
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    shared = tmp_path / "shared"
    path = f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"  # srun, then this environment's python
    cfg = _print_config(["bash", str(script), "--print-config", "--config", "parallel/fsdp.yaml", "train.steps=7"],
                        SHARED=str(shared), SLURM_JOB_ID="4242", SLURM_JOB_NAME="llm", PATH=path)
    assert cfg["distributed"]["initialize"] is True
    assert cfg["train"]["resume"] == "auto" and cfg["train"]["steps"] == 7  # the caller's overrides come last
    assert cfg["mesh"]["fsdp"] == -1  # ... and so do the caller's --config files (parallel/fsdp.yaml)
    assert cfg["train"]["output_dir"] == f"{shared}/runs/llm"  # checkpoints default to <output_dir>/checkpoints
    assert cfg["checkpoint"]["dir"] == "" and cfg["checkpoint"]["enabled"] is True
    assert cfg["data"]["cache_dir"] == f"{shared}/data-cache"
    assert (shared / "jax-cache").is_dir() and (shared / "runs" / "llm").is_dir()


def jobset_documents() -> tuple[dict, dict]:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "jobset.yaml").read_text()))
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"PersistentVolumeClaim", "JobSet"}, list(by_kind)
    return by_kind["JobSet"], by_kind["PersistentVolumeClaim"]


def test_jobset_processes_indices_coordinator_and_storage_agree():
    jobset, claim = jobset_documents()
    assert jobset["apiVersion"].startswith("jobset.x-k8s.io/")
    [replicated] = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    pod = job["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    processes = int(env["MMJAX_NUM_PROCESSES"]["value"])
    assert job["parallelism"] == job["completions"] == processes and replicated["replicas"] == 1
    assert job["completionMode"] == "Indexed"
    assert env["MMJAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    name = jobset["metadata"]["name"]
    host, port = env["MMJAX_COORDINATOR_ADDRESS"]["value"].split(":")
    assert host == f"{name}-{replicated['name']}-0-0.{name}" and jobset["spec"]["network"]["enableDNSHostnames"]
    assert {"containerPort": int(port)} in container["ports"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    assert env["JAX_COMPILATION_CACHE_DIR"]["value"].startswith(mounts["shared"] + "/")
    assert pod["securityContext"]["runAsUser"] != 0 and container["resources"]["limits"]["nvidia.com/gpu"] >= 1


def test_jobset_command_resolves_with_print_config():
    jobset, _ = jobset_documents()
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    command = container["command"]
    assert command[:3] == ["python", "-m", "mmjax.train"]
    shared = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["shared"]
    cfg = _print_config([sys.executable, *command[1:], "--print-config"], MMJAX_PROCESS_ID="1",
                        MMJAX_NUM_PROCESSES="2", MMJAX_COORDINATOR_ADDRESS="127.0.0.1:1234")
    assert cfg["train"]["resume"] == "auto" and cfg["train"]["output_dir"].startswith(shared + "/")
    assert cfg["data"]["cache_dir"].startswith(shared + "/")


def extras(command: str) -> set[str]:
    m = re.search(r"""["']?\.\[([\w,${}]+)\]["']?""", command)
    assert m, command
    return set(m.group(1).split(","))


def test_dockerfile_installs_what_the_readme_installs_as_a_non_root_user():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = re.sub(r"\\\n\s*", " ", text).splitlines()  # join continued lines
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    installs = [seg.strip() for line in lines if line.startswith("RUN") for seg in line[3:].split("&&")
                if re.search(r"pip install .*\.\[", seg)]
    assert len(installs) == 1, installs
    image_extras = {args.get(e.strip("${}"), e) if e.startswith("$") else e for e in extras(installs[0])}
    assert "-e" not in shlex.split(installs[0])  # the image holds an installed package, not a checkout link

    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Containers and clusters"):]
    section = section[:section.index("\n## ", 1)]
    readme_installs = [line for line in section.splitlines() if line.startswith("pip install")]
    assert readme_installs and all(extras(c) == image_extras for c in readme_installs), (readme_installs, image_extras)
    assert "gpu" in image_extras
    optional = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert image_extras <= set(optional)

    assert re.search(r"^FROM \$\{CUDA_IMAGE\}", text, re.M) and args["CUDA_IMAGE"].startswith("nvidia/cuda:")
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    cache = re.search(r"^ENV JAX_COMPILATION_CACHE_DIR=(\S+)", text, re.M).group(1)
    volumes = re.search(r"^VOLUME \[(.*)\]", text, re.M).group(1)
    assert any(cache.startswith(v.strip(' "') + "/") for v in volumes.split(","))
    for copied in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, re.M):
        for name in copied.split():
            assert (REPO / name).exists(), name


@pytest.mark.parametrize("path", ["deploy/slurm/train.sbatch"])
def test_shell_scripts_parse(path):
    subprocess.run(["bash", "-n", str(REPO / path)], check=True)
