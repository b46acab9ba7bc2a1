import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmjax.config import Config, load_config, parse_cli, to_yaml
from mmjax.errors import ConfigError
from mmjax.training.checks import check_runnable

REPO = Path(__file__).resolve().parents[2]


def test_defaults_and_overrides():
    cfg = load_config(None, ["train.steps=7", "model.text.dim=64", "optim.lr=1e-3", "model.vision.mean=[0.1,0.2,0.3]"])
    assert cfg.train.steps == 7 and cfg.model.text.dim == 64 and cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.model.vision.mean == (0.1, 0.2, 0.3)
    assert load_config(None) == Config()


def test_int_is_accepted_for_float_but_not_bool_for_int():
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0
    with pytest.raises(ConfigError, match="train.steps must be int"):
        load_config(None, ["train.steps=true"])


def test_yaml_base_inheritance(tmp_path):
    (tmp_path / "base.yaml").write_text("train: {steps: 10, seed: 3}\nmodel: {text: {dim: 64}}\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\ntrain: {steps: 20}\n")
    cfg = load_config(tmp_path / "child.yaml", ["train.seed=5"])
    assert (cfg.train.steps, cfg.train.seed, cfg.model.text.dim) == (20, 5, 64)


def test_base_loop_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(tmp_path / "a.yaml")


@pytest.mark.parametrize("override, message", [
    ("train.no_such_key=1", "unknown config key train.no_such_key"),
    ("train.step=1", "did you mean train.steps"),
    ("nosection.x=1", "unknown config key nosection"),
    ("train.steps=abc", "train.steps must be int"),
    ("model.text=3", "model.text must be a mapping"),
    ("model.text.n_kv_heads=3", "must be a multiple of model.text.n_kv_heads=3"),
    ("model.vision.patch_size=7", "not a multiple of model.vision.patch_size"),
    ("model.compute_dtype=float8", "model.compute_dtype='float8' is not one of: auto, float32, bfloat16, float16"),
    ("model.param_dtype=auto", "model.param_dtype='auto' is not one of: float32, bfloat16, float16"),
    ("model.remat=dot", "model.remat='dot' is not one of: none, full, dots, dots_no_batch, save_attention_out; "
                        "did you mean dots?"),
    ("parallel.zero_stage=4", "parallel.zero_stage=4 is not one of: 1, 2, 3"),
    ("parallel.zero_stage=true", "parallel.zero_stage=True is not one of: 1, 2, 3"),
    ("observe.sinks=[jsonl,grafana]", "observe.sinks='grafana' is not one of: jsonl, progress, tensorboard"),
    ("data.storage_options=3", "data.storage_options must be a mapping with string keys, got 3"),
    ("train.grad_accum_steps=5", "not divisible by train.grad_accum_steps"),
    ("model.max_seq_len=8", "model.max_seq_len=8 cannot hold"),
    ("model.projector.pos_embed=sincos", "model.projector.pos_embed='sincos' is not one of: none, learned"),
    ("model.vision.pos_temperature=1", "model.vision.pos_temperature must be > 1"),
    ("model.loss_chunk_tokens=-512", "model.loss_chunk_tokens must be >= 0 (0: automatic), got -512"),
    ("mesh.data=-1", None),
])
def test_each_error_kind_names_the_key(override, message):
    if message is None:
        load_config(None, [override])
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])


def test_yaml_roundtrip():
    cfg = load_config(None, ["train.steps=11"])
    assert to_yaml(cfg).count("steps: 11") == 1


@pytest.mark.parametrize("override, named", [("train.no_such_key=1", "train.no_such_key"),
                                             ("observe.progress=false", "observe.sinks")])  # unknown, removed
def test_cli_bad_key_exits_2_with_one_line(override, named):
    proc = subprocess.run([sys.executable, "-m", "mmjax.train", override], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0]


def test_cli_print_config_resolves_default_file():
    proc = subprocess.run([sys.executable, "-m", "mmjax.train", "--print-config", "train.steps=3"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "steps: 3" in proc.stdout and "dataset: shapes" in proc.stdout


def test_choice_keys_are_literal_types():
    """Every fixed set of choices is a Literal on the dataclass, so the loader checks it (no hand-written list)."""
    import dataclasses
    import typing

    def choices(cls, prefix=""):
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(hint):
                yield from choices(hint, f"{prefix}{f.name}.")
                continue
            if typing.get_origin(hint) is tuple:
                hint = typing.get_args(hint)[0]
            if typing.get_origin(hint) is typing.Literal:
                yield f"{prefix}{f.name}"

    assert set(choices(Config)) == {
        "model.text.rope_scaling", "model.vision.pos_embed", "model.vision.act", "model.projector.pos_embed",
        "model.compute_dtype", "model.param_dtype", "model.remat", "model.image_attention", "model.matmul_precision",
        "parallel.zero_stage", "parallel.context_parallel", "parallel.xla_flags_preset",
        "parallel.pipeline_schedule", "parallel.pipeline_balance", "parallel.pipeline_weight_gather",
        "distributed.cpu_collectives", "data.source", "data.pack_strategy", "data.image_mode", "optim.schedule",
        "observe.sinks", "observe.wandb_mode", "observe.neptune_mode", "observe.nan_policy", "serve.kv_cache_dtype",
        "serve.quantization", "serve.default_sla_class", "serve.speculative.method", "serve.router"}
    assert load_config(None, ["parallel.zero_stage=1"]).parallel.zero_stage == 1


@pytest.mark.parametrize("override, message", [
    ("observe.progress=false", "config key observe.progress was removed; add `progress` to observe.sinks"),
    ("train.micro_batch_size=4", "config key train.micro_batch_size was removed; .* use train.grad_accum_steps"),
])
def test_removed_keys_name_their_replacement(override, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
    section, key = override.split("=")[0].split(".")
    (tmp_path / "old.yaml").write_text(f"{section}:\n  {key}: 1\n")  # in a YAML file too
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path / "old.yaml")


def test_storage_options_is_a_mapping(tmp_path):
    cfg = load_config(None, ['data.storage_options={"anon": true, "endpoint_url": "http://127.0.0.1:9000"}'])
    assert cfg.data.storage_options == {"anon": True, "endpoint_url": "http://127.0.0.1:9000"}
    (tmp_path / "s3.yaml").write_text("data:\n  storage_options: {anon: true}\n")
    assert load_config(tmp_path / "s3.yaml").data.storage_options == {"anon": True}
    assert load_config(None).data.storage_options == {}
    assert "storage_options:\n    anon: true" in to_yaml(load_config(tmp_path / "s3.yaml"))
    with pytest.raises(ConfigError, match="data.storage_options must be a mapping, not the string"):
        load_config(None, ["data.storage_options='{\"anon\": true}'"])  # the old JSON-string form


def test_kernel_impl_that_cannot_run_here_fails_at_config_time():
    """The tests pin JAX to the CPU: Mosaic GPU, cuDNN and jax-triton kernels cannot run; Pallas can (interpret).
    The config validates without the kernels; the run's check (`python -m mmjax.train` before anything is built)
    asks them."""
    for override, reason in [("model.attention_impl=mgpu", "Mosaic GPU flash attention needs a CUDA GPU, not cpu"),
                             ("model.attention_impl=cudnn", "cuDNN flash attention needs a CUDA GPU"),
                             ("model.activation_impl=triton", "jax-triton kernels run only on a CUDA GPU"),
                             ("model.swiglu_impl=triton", "is not one of")]:
        key = override.split("=")[0]
        cfg = load_config(None, [override])
        with pytest.raises(ConfigError, match=f"{key}=.* {reason}"):
            check_runnable(cfg)
    for ok in ["model.attention_impl=pallas", "model.attention_impl=xla", "model.norm_impl=pallas",
               "model.attention_impl=auto", "model.swiglu_impl=pallas"]:
        check_runnable(load_config(None, [ok]))


def test_train_cli_exits_2_on_a_kernel_that_cannot_run(capsys):
    from mmjax.train import main

    assert main(["model.attention_impl=mgpu", "--print-config"]) == 2
    assert "config error: model.attention_impl=mgpu cannot run on this machine" in capsys.readouterr().err


def test_kernel_support_query_needs_no_backend():
    """The query answers without starting a backend (XLA flags and jax.distributed come after the config)."""
    code = ("import jax; from jax._src import xla_bridge as xb; from mmjax import kernels; "
            "r = kernels.OPS['attention'].unsupported_here('mgpu'); "
            "print(repr(r), xb.backends_are_initialized())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("False") and "needs a CUDA GPU" in proc.stdout




def test_overrides_are_taken_out_wherever_they_stand_even_after_an_option_of_several_values():
    p = argparse.ArgumentParser()
    p.add_argument("--methods", nargs="+", choices=("none", "ngram", "draft"))
    p.add_argument("--batches", type=int, nargs="+")
    p.add_argument("--variant", action="append", default=[])
    p.add_argument("overrides", nargs="*")
    args = parse_cli(p, ["a.b=1", "--methods", "none", "draft", "serve.x.y=true", "--batches", "1", "8",
                         "serve.z=[1,2]", "--variant", "fused=optim.fused=true"])
    assert args.methods == ["none", "draft"] and args.batches == [1, 8]
    assert args.overrides == ["a.b=1", "serve.x.y=true", "serve.z=[1,2]"]  # in order
    assert args.variant == ["fused=optim.fused=true"]  # a NAME=... value stays its option's
    with pytest.raises(SystemExit):  # a bad value still fails, naming the option
        parse_cli(p, ["--methods", "bogus", "a.b=1"])


def test_train_serve_and_generate_take_overrides_before_and_after_their_options():
    from mmjax.generate import parse_args as generate_args
    from mmjax.serve import parse_args as serve_args
    from mmjax.train import parse_args as train_args
    assert train_args(["train.steps=3", "--config", "x.yaml", "mesh.tensor=2"]).overrides == [
        "train.steps=3", "mesh.tensor=2"]
    assert serve_args(["serve.port=1", "--random-init", "serve.max_num_seqs=4"]).overrides == [
        "serve.port=1", "serve.max_num_seqs=4"]
    g = generate_args(["hf:some/folder", "serve.num_pages=64", "--prompt", "hi", "model.x=1"])
    assert g.overrides == ["serve.num_pages=64", "model.x=1"] and g.prompt == "hi"
