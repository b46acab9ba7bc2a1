"""The typed run configuration: frozen dataclasses, YAML with `base:` inheritance, dotted CLI overrides.

Every key a user can set lives in one dataclass below, so the tree is the documentation. Loading goes
YAML file(s) -> nested dict -> overrides -> dataclasses (type-checked) -> cross-field validation, and
every failure is a `ConfigError` naming the key and the fix, raised before anything is compiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from mmjax.errors import ConfigError

ParamDtype = Literal["float32", "bfloat16", "float16"]
ComputeDtype = Literal["auto", "float32", "bfloat16", "float16"]  # auto = bfloat16 on GPU/TPU, float32 on CPU
RematPolicy = Literal["none", "full", "dots", "dots_no_batch", "save_attention_out"]  # mmjax.model.layers maps them
Sink = Literal["jsonl", "progress", "tensorboard", "wandb", "prometheus", "mlflow", "neptune"]

# Keys that existed once: setting one fails with what to do instead (not a bare "unknown key").
REMOVED_KEYS = {
    "train.micro_batch_size": "removed; rows per rank follow from train.global_batch_size, the mesh and "
                              "train.grad_accum_steps: use train.grad_accum_steps",
    "observe.progress": "removed; add `progress` to observe.sinks for the progress bar, or leave it out "
                        "(e.g. observe.sinks=[jsonl])",
}


def cache_root() -> Path:
    """mmjax's cache folder: $MMJAX_CACHE, else $XDG_CACHE_HOME/mmjax, else ~/.cache/mmjax."""
    if os.environ.get("MMJAX_CACHE"):
        return Path(os.environ["MMJAX_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "mmjax"


def need(ok: bool, msg: str) -> None:
    """Raise `ConfigError(msg)` unless `ok`: the one-line check each section's `validate` is written in."""
    if not ok:
        raise ConfigError(msg)


def need_positive(pairs: list[tuple[str, int | float]]) -> None:
    for name, value in pairs:
        need(value > 0, f"{name} must be positive, got {value}")


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """Llama-style decoder."""

    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 0  # 0 = dim // n_heads
    mlp_dim: int = 384
    rope_theta: float = 10000.0
    # RoPE frequency scaling: "none", or "llama3" (Llama 3.1/3.2 long-context scaling with the factors below)
    rope_scaling: Literal["none", "llama3"] = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    def validate(self) -> None:
        need_positive([("model.text.dim", self.dim), ("model.text.n_layers", self.n_layers),
                       ("model.text.n_heads", self.n_heads), ("model.text.n_kv_heads", self.n_kv_heads),
                       ("model.text.mlp_dim", self.mlp_dim)])
        need(self.n_heads % self.n_kv_heads == 0,
             f"model.text.n_heads={self.n_heads} must be a multiple of model.text.n_kv_heads={self.n_kv_heads}")
        need(self.head_dim > 0 or self.dim % self.n_heads == 0,
             f"model.text.dim={self.dim} is not divisible by model.text.n_heads={self.n_heads}; "
             "set model.text.head_dim")
        need(self.resolved_head_dim % 2 == 0, f"RoPE needs an even head dim, got {self.resolved_head_dim}")
        need(self.rope_scaling == "none"
             or (self.rope_factor > 0 and self.rope_high_freq_factor > self.rope_low_freq_factor > 0),
             "model.text.rope_scaling=llama3 needs rope_factor > 0 and "
             "rope_high_freq_factor > rope_low_freq_factor > 0")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """ViT encoder; images arrive as [H, W, C] floats normalised with `mean`/`std`."""

    image_size: int = 48
    patch_size: int = 16
    channels: int = 3
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    mlp_dim: int = 384
    norm_eps: float = 1e-6
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    # "learned" (CLIP/SigLIP style, what converted checkpoints carry) or "sincos2d" (fixed 2-D sin/cos,
    # MAE/big_vision style: patch positions are distinct from step 0, which a from-scratch tower needs)
    pos_embed: Literal["learned", "sincos2d"] = "learned"
    # sincos2d frequencies run from 1 down to 1/pos_temperature. 10000 suits 14x14+ grids; on a tiny grid
    # (3x3 patches) most of them barely change across the image, so small towers want ~3-10
    pos_temperature: float = 10000.0
    # CLIP-tower options (LLaVA checkpoints set them; defaults keep the plain ViT above):
    class_token: bool = False  # a learned [CLS] token is prepended (and dropped from the output)
    pre_norm: bool = False  # LayerNorm on the embeddings before the first block (CLIP's pre_layrnorm)
    final_norm: bool = True  # LayerNorm after the last block (LLaVA reads CLIP features without it)
    act: Literal["gelu", "gelu_tanh", "quick_gelu"] = "gelu"  # MLP activation: gelu is exact; quick_gelu: CLIP
    # the tower's layer loop: null follows model.scan_layers; true scans it, false unrolls it, whatever the decoder
    # does. A scanned tower over unrolled decoder layers keeps most of the unrolled step's speed at a shorter
    # compile (docs/perf/train.md, "Compile time of the MLLM").
    scan_layers: bool | None = None

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def validate(self) -> None:
        need_positive([("model.vision.dim", self.dim), ("model.vision.n_layers", self.n_layers),
                       ("model.vision.n_heads", self.n_heads), ("model.vision.mlp_dim", self.mlp_dim)])
        need(self.dim % self.n_heads == 0,
             f"model.vision.dim={self.dim} is not divisible by model.vision.n_heads={self.n_heads}")
        need(self.pos_temperature > 1.0,
             f"model.vision.pos_temperature must be > 1 (1 makes every sincos2d frequency the same), "
             f"got {self.pos_temperature}")
        need(self.pos_embed != "sincos2d" or self.dim % 4 == 0,
             f"model.vision.pos_embed=sincos2d needs model.vision.dim divisible by 4, got {self.dim}")
        need(self.image_size % self.patch_size == 0,
             f"model.vision.image_size={self.image_size} is not a multiple of "
             f"model.vision.patch_size={self.patch_size}")
        need(len(self.mean) == self.channels and len(self.std) == self.channels,
             f"model.vision.mean/std need {self.channels} values (one per channel)")


@dataclasses.dataclass(frozen=True)
class ProjectorConfig:
    """LLaVA-1.5 projector: Linear(vision -> hidden) -> GELU -> Linear(hidden -> text)."""

    hidden_dim: int = 0  # 0 = text.dim
    # "learned": a [image_tokens, text.dim] table added to the projected image tokens, so the decoder reads
    # where a patch sits from the token itself. Without it, only the ViT's position code (diluted by the
    # tower) and the decoder's 1-D RoPE order carry it; RoPE separates rows but hardly columns. LLaVA
    # checkpoints have none ("none").
    pos_embed: Literal["none", "learned"] = "none"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    max_seq_len: int = 64
    text: TextConfig = TextConfig()
    vision: VisionConfig = VisionConfig()
    projector: ProjectorConfig = ProjectorConfig()
    compute_dtype: ComputeDtype = "auto"
    param_dtype: ParamDtype = "float32"
    # true: lax.scan over stacked layers (the shortest compile; what a pipeline needs); false: the layers unrolled,
    # each one jitted function called per layer (no stacked residuals copied in and out: a faster training step,
    # a longer compile; docs/perf/train.md). Checkpoints keep the layers in the form the run used.
    scan_layers: bool = True
    remat: RematPolicy = "none"
    # "fp8": the decoder layers' training matmuls round their inputs to e4m3 and gradients to e5m2 (per-tensor
    # current scaling, mmjax.model.fp8), a pattern XLA can run as fp8 GEMMs on sm89+ GPUs. Serving is unaffected.
    matmul_precision: Literal["default", "fp8"] = "default"
    # kernels.attention: auto | mgpu | mgpu_bwd | pallas | cudnn | xla | chunked | reference
    attention_impl: str = "auto"
    norm_impl: str = "auto"        # kernels.rms_norm / layer_norm: auto | pallas | triton | xla
    loss_impl: str = "auto"        # kernels.linear_cross_entropy: auto | chunked | xla
    # tokens per chunk of the chunked cross-entropy; 0: as many as fit its float32 temporaries' budget
    # (kernels.cross_entropy.CHUNK_BYTES). Larger chunks: fewer passes over the float32 LM-head weight-gradient
    # sum, more memory for the [chunk, vocab] temporaries.
    loss_chunk_tokens: int = 0
    activation_impl: str = "auto"  # kernels.bias_gelu (ViT MLP, projector): auto | triton | pallas | xla
    swiglu_impl: str = "auto"      # kernels.swiglu (decoder MLP): auto | pallas | xla
    text_only: bool = False  # decoder only: no vision tower or projector; batches carry no images
    # Image placeholder tokens attend "bidirectional"ly within their image, or "causal"ly like any token
    # (what LLaVA in transformers does; converted LLaVA checkpoints set it).
    image_attention: Literal["bidirectional", "causal"] = "bidirectional"
    # "hf:PATH": start from a Hugging Face model folder: shapes from its config.json (other keys may be
    # overridden), weights converted once into data.cache_dir, tokenizer + chat template from the folder.
    # "gguf:FILE" (llama.cpp's format): the run converts the file into such a folder first (hf: after loading)
    init_from: str = ""

    @property
    def image_tokens(self) -> int:
        """Placeholder tokens one image fills in the text sequence."""
        return self.vision.num_patches

    @property
    def vision_scan_layers(self) -> bool:
        """Whether the vision tower scans its layers: model.vision.scan_layers, else model.scan_layers."""
        return self.scan_layers if self.vision.scan_layers is None else self.vision.scan_layers

    @property
    def layer_layout(self) -> dict[str, bool]:
        """Each tower's layer loop (true: stacked and scanned), by its name in the params tree."""
        return {"decoder": self.scan_layers, "vision": self.vision_scan_layers}

    def validate(self, cfg: Config) -> None:
        """Shapes only: whether a model.*_impl kernel can run on this machine is checked where the model is
        built (`mmjax.model.kernel_choices`), since asking needs the kernels."""
        need(self.loss_chunk_tokens >= 0,
             f"model.loss_chunk_tokens must be >= 0 (0: automatic), got {self.loss_chunk_tokens}")
        need_positive([("model.vocab_size", self.vocab_size), ("model.max_seq_len", self.max_seq_len)])
        need(self.init_from == "" or (self.init_from.startswith("hf:") and len(self.init_from) > 3),
             f"model.init_from={self.init_from!r} must be empty or hf:PATH (a local Hugging Face model folder); "
             "gguf:FILE is read by python -m mmjax.train, which converts it into such a folder")
        self.text.validate()
        self.vision.validate()
        need(self.text_only or cfg.data.max_images * self.image_tokens < self.max_seq_len,
             f"model.max_seq_len={self.max_seq_len} cannot hold data.max_images={cfg.data.max_images} images of "
             f"{self.image_tokens} tokens each plus text; raise model.max_seq_len or model.vision.patch_size")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes; one of them may be -1 (= the remaining devices)."""

    data: int = -1
    fsdp: int = 1
    pipeline: int = 1
    sequence: int = 1
    tensor: int = 1
    # How many of `data` / `fsdp` span nodes (GPU processes) or TPU slices; the rest of each axis, and all
    # of `sequence` and `tensor`, stay inside one. 1 = the whole axis is within a node.
    dcn_data: int = 1
    dcn_fsdp: int = 1
    dcn_pipeline: int = 1  # how many of `pipeline`'s stages sit on different nodes/slices (stage hops cross DCN)

    def validate(self, cfg: Config) -> None:
        """Sizes only: against the device count in `mmjax.parallel.mesh`, against the pipeline planner in
        `mmjax.training.pipeline` (both know what this module does not)."""
        sizes = {k: v for k, v in dataclasses.asdict(self).items() if not k.startswith("dcn_")}
        need(min(self.dcn_data, self.dcn_fsdp, self.dcn_pipeline) >= 1,
             "mesh.dcn_data, mesh.dcn_fsdp and mesh.dcn_pipeline must be >= 1")
        need(list(sizes.values()).count(-1) <= 1,
             f"at most one mesh axis may be -1 (the rest of the devices), got {sizes}")
        need(all(s == -1 or s > 0 for s in sizes.values()), f"mesh sizes must be positive or -1, got {sizes}")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How logical axes map onto the mesh, ZeRO stage, sequence/context parallelism (docs/parallelism.md)."""

    # logical axis -> mesh axis, list of mesh axes, or null; merged over mmjax.parallel.rules.DEFAULT_RULES
    rules: dict[str, Any] = dataclasses.field(default_factory=dict)
    # 3: params+grads+opt state sharded over fsdp; 1/2: params replicated, opt state sharded
    zero_stage: Literal[1, 2, 3] = 3
    sequence_parallel: bool = False  # Megatron SP: norm/residual activations split over `tensor` along length
    context_parallel: Literal["allgather", "ring"] = "ring"  # attention when mesh.sequence > 1: allgather (KV) | ring
    load_balance: bool = True  # ring: zigzag causal layout so every sequence shard does equal work
    # mesh.pipeline > 1 (docs/parallelism.md#pipeline-parallelism): microbatches = train.grad_accum_steps
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    pipeline_virtual_stages: int = 1  # v decoder chunks per pipeline rank (interleaved_1f1b only)
    pipeline_schedule_file: str = ""  # a CSV schedule (rank,tick,kind,chunk,micro) instead of pipeline_schedule
    pipeline_balance: Literal["even", "cost"] = "cost"  # stage cut: equal layer counts, or equal cost
    pipeline_head_cost: float = 2.0  # final norm + LM head + loss, in decoder layers, for the cost balance
    # step: FSDP weights gathered once per step, gradients reduced over data x fsdp once per step (holds a
    # stage's whole weights and gradients per device); use: gathered at each use and reduced per microbatch
    pipeline_weight_gather: Literal["step", "use"] = "step"
    xla_flags_preset: Literal["none", "gpu_overlap"] = "none"  # gpu_overlap: latency-hiding scheduler, async comms
    xla_flags: str = ""  # extra XLA flags appended to XLA_FLAGS before the backend starts
    # share of each GPU's memory JAX's allocator takes at start (XLA_CLIENT_MEM_FRACTION; JAX alone takes 0.75;
    # 0 = JAX's choice). A training process owns its GPUs; the slack keeps steps of several shapes (data.buckets)
    # from fragmenting the pool. An allocator setting already in the environment wins.
    gpu_memory_fraction: float = 0.9
    # XLA's persistent compilation cache: compiled programs kept on disk, so a rerun of the same step (same model,
    # shapes, flags and jax version) loads its executable instead of compiling it. auto: $JAX_COMPILATION_CACHE_DIR
    # if set, else <mmjax cache>/xla ($MMJAX_CACHE/xla, else ~/.cache/mmjax/xla); "": no cache; or a folder.
    compilation_cache_dir: str = "auto"

    def validate(self, cfg: Config) -> None:
        cache = Path(self.compilation_cache_dir).expanduser()
        need(self.compilation_cache_dir in ("", "auto") or not cache.exists() or cache.is_dir(),
             f"parallel.compilation_cache_dir={cache} exists and is not a folder; use auto, \"\" (off) or a folder")
        need(0.0 <= self.gpu_memory_fraction <= 1.0,
             f"parallel.gpu_memory_fraction={self.gpu_memory_fraction} must be in (0, 1], or 0 for JAX's default")
        axes = ("data", "fsdp", "pipeline", "sequence", "tensor")
        for key, target in self.rules.items():
            targets = target if isinstance(target, list) else [] if target is None else [target]
            need(all(isinstance(a, str) and a in axes for a in targets),
                 f"parallel.rules.{key}={target!r}: map a logical axis to null, one of {axes}, or a list of them")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process runs through `jax.distributed.initialize` (one process per host or per GPU)."""

    initialize: bool = False  # true: call jax.distributed.initialize (JAX auto-detects SLURM/K8s/TPU)
    coordinator_address: str = ""  # host:port of process 0; setting it implies initialize
    num_processes: int = 0  # 0 = auto-detected
    process_id: int = -1  # -1 = auto-detected
    cpu_collectives: Literal["gloo", "mpi"] = "gloo"  # CPU cross-process collectives
    initialization_timeout: int = 300  # seconds to wait for every process to join

    def validate(self, cfg: Config) -> None:
        """Nothing to check before `jax.distributed` runs: it names a bad address or process count itself."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    dataset: str = "shapes"  # built-in dataset name
    cache_dir: str = "~/.cache/mmjax"
    num_train: int = 20000
    num_eval: int = 500
    num_shards: int = 4
    questions_per_image: int = 1  # shapes: question/answer turns per train image (eval records hold one)
    tokenizer: str = ""  # path to tokenizer.json; empty = the built-in dataset's tokenizer
    max_images: int = 1  # image slots per row
    shuffle: bool = True
    num_workers: int = 0  # Grain worker processes; 0 = in-process
    prefetch: int = 2  # batches buffered ahead of the train loop
    # -- user datasets and loader behaviour (mmjax/data/sources, mmjax/data/loader.py) --
    # builtin: data.dataset; llava: LLaVA JSON/JSONL + images
    source: Literal["builtin", "arrayrecord", "parquet", "llava"] = "builtin"
    paths: tuple[str, ...] = ()  # train files, directories or globs; local paths or fsspec URLs (s3://, gs://, ...)
    eval_paths: tuple[str, ...] = ()  # held-out records for generation eval (same format); empty = no eval
    image_root: str = ""  # llava/parquet: base URL of relative image paths (default: beside the JSON file)
    # fsspec filesystem arguments, e.g. data.storage_options={"endpoint_url": "http://127.0.0.1:9000"}
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    shuffle_window: int = 0  # 0 = global shuffle; k > 0 = shuffle shard order + records within k shards
    remote_cache_shards: int = 8  # remote ArrayRecord shards kept in the local cache (per host)
    packing: bool = False  # first-fit pack several sequences per row (segment_ids 1..k)
    pack_strategy: Literal["first_fit", "best_fit"] = "first_fit"
    pack_lookahead: int = 64  # examples held back while the current batch's rows still have room
    max_skip_fraction: float = 0.01  # share of bad records (skipped, counted) beyond which the run stops
    verify_checksums: bool = False  # SHA-256 of every shard against its manifest at open (always when cheap)
    image_mode: Literal["pad", "crop"] = "pad"  # pad: letterbox, aspect kept; crop: resize shorter side, centre crop
    image_tiles: int = 0  # g >= 2: an image = a thumbnail + g x g tiles of it at g x image_size (1 + g^2 slots)
    pad_to_multiple: int = 1  # packed sequences start at multiples of this (8/16/128: kernel block alignment)
    # -- bucketing (mmjax/data/bucketing.py): batches take the smallest bucket shape that holds their rows --
    buckets: tuple[int, ...] | str = ()  # row lengths; () = off (rows of model.max_seq_len); auto = from the data
    bucket_align: int = 128  # every row-length bucket is a multiple of this (model.max_seq_len is always one)
    num_auto_buckets: int = 4  # data.buckets=auto: row-length buckets chosen, model.max_seq_len included
    image_buckets: tuple[int, ...] = ()  # image slots per row; data.max_images is always one
    bucket_max_wait: int = 16  # batches' worth of examples a queued example waits before its batch is closed

    def validate(self, cfg: Config) -> None:
        need_positive([("data.num_shards", self.num_shards)])
        need(self.num_workers >= 0, "data.num_workers must be >= 0")
        need(self.source == "builtin" or bool(self.paths),
             f"data.source={self.source} needs data.paths (files, directories, globs or fsspec URLs)")
        need(self.source == "builtin" or bool(self.tokenizer),
             f"data.source={self.source} needs data.tokenizer (path to the model's tokenizer.json; train one with "
             "python -m mmjax.tools.train_tokenizer)")
        need(0.0 <= self.max_skip_fraction <= 1.0, "data.max_skip_fraction must be within [0, 1]")
        need(self.shuffle_window >= 0, "data.shuffle_window must be >= 0 (0 = global shuffle)")
        need(self.pack_lookahead >= 0, "data.pack_lookahead must be >= 0")
        need(self.remote_cache_shards >= 1, "data.remote_cache_shards must be >= 1")
        max_len = cfg.model.max_seq_len
        need(self.pad_to_multiple >= 1 and max_len % self.pad_to_multiple == 0,
             f"data.pad_to_multiple={self.pad_to_multiple} must be >= 1 and divide model.max_seq_len={max_len}")
        validate_buckets(cfg)
        need(self.image_tiles == 0 or (self.image_tiles >= 2 and self.max_images >= 1 + self.image_tiles**2),
             f"data.image_tiles={self.image_tiles} must be 0 (off) or >= 2 with data.max_images >= "
             f"{1 + max(self.image_tiles, 2) ** 2} (a thumbnail + g x g tile slots per image)")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    schedule: Literal["cosine", "polynomial", "constant"] = "cosine"
    power: float = 1.0  # polynomial decay exponent
    schedule_steps: int = 0  # 0 = train.steps
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_grad_norm: float = 1.0  # 0 = no clipping
    # true: the optimizer updates a few flat buffers (parameters of one dtype and weight-decay class concatenated)
    # instead of each parameter apart: a few large kernels instead of one per parameter, the same updates.
    # One device only; its checkpoints keep the moments in that form (resume them with the same setting).
    fused: bool = False
    loss_scale_init: float = 2.0**15  # fp16 only
    loss_scale_growth_interval: int = 1000
    loss_scale_factor: float = 2.0

    def validate(self, cfg: Config) -> None:
        need(self.warmup_steps >= 0, "optim.warmup_steps must be >= 0")
        need(self.schedule_steps >= 0, "optim.schedule_steps must be >= 0 (0 = train.steps)")
        need(0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio must be within [0, 1]")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    seed: int = 0
    global_batch_size: int = 64
    grad_accum_steps: int = 1
    output_dir: str = "runs/tiny_shapes"
    # auto: continue from the latest complete checkpoint in checkpoint.dir (fresh start if none);
    # never: fresh start (refused if checkpoint.dir already holds checkpoints); N: that step of
    # checkpoint.dir; a path: a checkpoint folder (or one step folder in it), e.g. from another run.
    resume: str | int = "auto"

    def validate(self, cfg: Config) -> None:
        need_positive([("train.steps", self.steps), ("train.global_batch_size", self.global_batch_size),
                       ("train.grad_accum_steps", self.grad_accum_steps)])
        need(self.global_batch_size % self.grad_accum_steps == 0,
             f"train.global_batch_size={self.global_batch_size} is not divisible by "
             f"train.grad_accum_steps={self.grad_accum_steps}")
        resume = self.resume
        need(not isinstance(resume, int) or resume >= 0,
             f"train.resume={resume} must be auto, never, a step >= 0 or a checkpoint path")
        need(isinstance(resume, int) or resume.strip() != "",
             "train.resume is empty; use auto, never, a step number or a checkpoint path")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints of the full train state + data iterator (mmjax.checkpoint.orbax_state)."""

    enabled: bool = True
    dir: str = ""  # "" = <train.output_dir>/checkpoints
    every_steps: int = 1000  # 0 = only at the end (and on SIGTERM/SIGINT)
    keep: int = 3  # latest checkpoints kept; 0 = keep all
    keep_every: int = 0  # additionally keep every step that is a multiple of this forever; 0 = none
    async_save: bool = dataclasses.field(default=True, metadata={"key": "async"})
    # async, single-process only: copy the state on the device first and save that from a background
    # thread, so the loop does not wait for the device-to-host copy (needs free device memory the size of
    # the train state)
    device_snapshot: bool = True

    def validate(self, cfg: Config) -> None:
        for name, value in [("checkpoint.every_steps", self.every_steps), ("checkpoint.keep", self.keep),
                            ("checkpoint.keep_every", self.keep_every)]:
            need(value >= 0,
                 f"{name} must be >= 0 (0 = {'only at the end' if 'every_steps' in name else 'off'}), got {value}")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every_steps: int = 500  # 0 = only at the end
    num_examples: int = 500  # held-out examples scored at most (all of them when the eval set is smaller)
    batch_size: int = 100
    max_new_tokens: int = 8

    def validate(self, cfg: Config) -> None:
        need_positive([("eval.batch_size", self.batch_size)])
        need(self.num_examples > 0, f"eval.num_examples must be positive, got {self.num_examples}")


@dataclasses.dataclass(frozen=True)
class ObserveConfig:
    """Metrics, sinks, health checks and profiles (docs/metrics.md lists every metric)."""

    log_every: int = 50
    sinks: tuple[Sink, ...] = ("jsonl", "progress")
    tensorboard_dir: str = ""  # "" = <train.output_dir>/tensorboard
    wandb_project: str = "mmjax"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"  # offline: no network; `wandb sync` later
    prometheus_port: int = 9400  # /metrics on this port + process index (0 = any free port, logged)
    prometheus_addr: str = "0.0.0.0"
    # MLflow: "" = $MLFLOW_TRACKING_URI, else a file store in <train.output_dir>/mlruns; http://host:5000, sqlite:///x.db
    mlflow_tracking_uri: str = ""
    mlflow_experiment: str = "mmjax"
    neptune_project: str = ""  # workspace/project; "" = $NEPTUNE_PROJECT
    neptune_mode: Literal["offline", "async", "disabled"] = "offline"  # offline: no network; `neptune sync` later
    peak_flops_per_device: float = 0.0  # for train/mfu; 0 = look up the device kind (none on CPU)
    step_time_window: int = 100  # steps behind time/step_p50 and time/step_p90
    # non-finite loss/grads: skip the update | halt (checkpoint, stop) | warn (apply it)
    nan_policy: Literal["skip", "halt", "warn"] = "skip"
    watchdog_timeout_s: float = 900.0  # dump all thread stacks when no step completes for this long; 0 = off
    startup_timeout_s: float = 300.0  # report what start-up waits for (devices, first batch, compile) after this
    profile_steps: tuple[tuple[int, ...], ...] = ()  # [[first, last], ...] step ranges traced with jax.profiler

    def validate(self, cfg: Config) -> None:
        need_positive([("observe.log_every", self.log_every)])
        need(0 <= self.prometheus_port < 65536, f"observe.prometheus_port={self.prometheus_port} is not a TCP port")
        need(self.step_time_window > 0, "observe.step_time_window must be positive")
        need("mlflow" not in self.sinks or bool(self.mlflow_experiment.strip()),
             "observe.mlflow_experiment must name an MLflow experiment (default: mmjax)")
        need(not self.neptune_project or re.fullmatch(r"[^/\s]+/[^/\s]+", self.neptune_project) is not None,
             f"observe.neptune_project={self.neptune_project!r} must be 'workspace/project'")
        need(self.watchdog_timeout_s >= 0 and self.startup_timeout_s >= 0,
             "observe.watchdog_timeout_s and observe.startup_timeout_s must be >= 0 (0 = off)")
        for r in self.profile_steps:
            need(len(r) == 2 and 1 <= r[0] <= r[1],
                 f"observe.profile_steps entry {list(r)} must be [first, last] with 1 <= first <= last, "
                 "e.g. [[10, 12]]")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding in the serving engine (`mmjax.serving.speculative`): a proposer guesses
    `num_tokens` tokens per decoding request and the model verifies them in its one step."""

    method: Literal["none", "ngram", "draft"] = "none"  # ngram: prompt lookup; draft: a smaller mmjax model
    num_tokens: int = 4  # k: tokens proposed per request and step
    adaptive: bool = False  # per request: k + 1 after a step that accepted all, k - 1 after one under half (1..k)
    ngram_max: int = 4  # longest suffix n-gram looked up in the request's own tokens
    ngram_min: int = 1
    # the proposer runs on the device inside the target's verifying step, so a speculative step is one device call
    # and the host never sees the proposals; each decoding request reserves num_tokens draft slots per step.
    # ngram: the lookup, over each speculating request's token history kept there (serving/speculative/
    # device_ngram.py); draft: the draft model's k steps over its own pool (serving/speculative/draft_device.py)
    proposer_on_device: bool = False
    # with proposer_on_device: speculative rounds per device call (propose, verify, advance, R times in one
    # lax.scan) when every running request speculates; the scheduler reserves KV for rounds x (k + 1) tokens per
    # request (the draft model's proposer as much draft KV) and the host applies the tokens afterwards
    # (serving/step_programs.py, `StepPrograms.rounds_scan`: n-gram lookup or the draft model's steps per round)
    rounds: int = 1
    draft_checkpoint: str = ""  # draft: an mmjax checkpoint (same tokenizer), served text-only
    draft_overrides: tuple[str, ...] = ()  # draft: dotted config overrides for loading it
    # dynamic: per step, a cost model (mmjax.serving.speculative.policy) picks k in [0, num_tokens] from the step
    # times the engine measures (plain multi-step calls and speculative steps at each k, per batch-size bucket) and
    # each request's measured acceptance; k = 0 runs the plain fast path (decode_steps calls, async scheduling)
    dynamic: bool = False
    dynamic_ema: float = 0.2  # weight of a new sample in the step-time and acceptance averages, in (0, 1]
    dynamic_prior_acceptance: float = 0.5  # acceptance assumed before any request was measured, in [0, 1)
    dynamic_probe_every: int = 64  # while off: a speculative step every this many steps (0 = never) re-measures

    def validate(self) -> None:
        need(1 <= self.num_tokens <= 16, f"serve.speculative.num_tokens={self.num_tokens} must be in [1, 16]")
        need(not self.dynamic or self.method != "none",
             "serve.speculative.dynamic=true needs serve.speculative.method=ngram or draft (nothing to switch on)")
        need(0.0 < self.dynamic_ema <= 1.0, f"serve.speculative.dynamic_ema={self.dynamic_ema} must be in (0, 1]")
        need(0.0 <= self.dynamic_prior_acceptance < 1.0,
             f"serve.speculative.dynamic_prior_acceptance={self.dynamic_prior_acceptance} must be in [0, 1)")
        need(self.dynamic_probe_every >= 0,
             f"serve.speculative.dynamic_probe_every={self.dynamic_probe_every} must be >= 0 (0 = never probe)")
        need(1 <= self.ngram_min <= self.ngram_max, f"serve.speculative.ngram_min={self.ngram_min} / ngram_max="
             f"{self.ngram_max}: need 1 <= ngram_min <= ngram_max")
        need(not self.proposer_on_device or self.method != "none",
             "serve.speculative.proposer_on_device=true needs serve.speculative.method=ngram or draft (a proposer "
             "to run on the device)")
        need(1 <= self.rounds <= 64, f"serve.speculative.rounds={self.rounds} must be in [1, 64]")
        need(self.rounds == 1 or (self.method in ("ngram", "draft") and self.proposer_on_device),
             f"serve.speculative.rounds={self.rounds} needs serve.speculative.method=ngram or draft with "
             "proposer_on_device=true (the rounds propose on the device, from the token histories kept there or "
             "with the draft model run there); use rounds=1 otherwise")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """The serving engine (`mmjax.serving.engine`): KV pool, step budget, shape buckets, caches."""

    # The HTTP server (`python -m mmjax.serve`, mmjax/serving/http): address, name, admission control, logs.
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = ""  # the id clients pass as `model`; "" = the checkpoint run's folder name
    max_images_per_request: int = 4
    token_budget: float = 0.0  # prompt + max_tokens per second admitted (token bucket of 1 s); 0 = unlimited
    max_queue_len: int = 256  # requests waiting for their first step; more are refused (429)
    max_queue_wait_s: float = 30.0  # a request predicted (or found) to wait longer is refused (429)
    interactive_ttft_s: float = 2.0  # TTFT target of the `interactive` class: refused when predicted to miss
    default_sla_class: Literal["interactive", "batch"] = "interactive"
    request_log: str = ""  # JSON-lines file of per-request timings; "" = off
    drain_timeout_s: float = 60.0  # SIGTERM: longest wait for running requests before exiting
    # the engine (scheduler, KV pool, device) in a process of its own, fed token ids over ZeroMQ, so HTTP, text and
    # images never share the interpreter lock with the device loop (mmjax.serving.core); false: an engine thread of
    # the HTTP process (measured slower under load: docs/perf, "Serving")
    engine_process: bool = True
    # security (docs/serving.md, "Security"): keys, open routes, local media, input limits
    api_key: str = ""  # `Authorization: Bearer <key>` required off public_paths; comma-separated keys; "" = none
    # (the MMJAX_API_KEY environment variable adds keys the same way, and keeps them out of config files)
    public_paths: tuple[str, ...] = ("/health", "/ready", "/metrics")  # routes that need no key
    enable_docs: bool = False  # serve /docs and /openapi.json
    allowed_local_media_path: str = ""  # folder file:// image URLs may read under; "" = file:// refused
    max_request_bytes: int = 16 * 1024 * 1024  # request body (and file:// image) size limit; larger: 413
    max_image_pixels: int = 4096 * 4096  # width x height, read from the image's header before decoding

    # Scaling out (docs/serving.md, "Scaling out"; `mmjax.serving.cluster`, the cluster extra): engine replicas on
    # Ray Serve behind a prefix-aware router. 0 = one process, no Ray.
    replicas: int = 0  # engine replicas (the fixed count, or the autoscaler's start when max_replicas > 0)
    cluster_address: str = ""  # Ray cluster to join: "" = start a local one, "auto" = the running one, or an address
    min_replicas: int = 1  # autoscaling bounds, used when max_replicas > 0
    max_replicas: int = 0  # > 0: Ray Serve autoscales the replica count in [min_replicas, max_replicas]
    target_ongoing_requests: float = 8.0  # autoscaling: requests in flight per replica it aims for
    replica_cpus: float = 1.0  # Ray resources each replica asks for
    replica_gpus: float = 0.0  # 0 on CPU; with mesh.tensor=T a replica needs T GPUs
    router: Literal["prefix", "least_loaded"] = "prefix"  # prefix: longest routed prefix, then least loaded
    router_block_chars: int = 64  # the router hashes a prompt's text in blocks of this many characters
    router_max_imbalance: int = 8  # a prefix match is taken while its replica has at most this many more
    # requests in flight than the least-loaded replica; past it the least-loaded one serves
    router_retries: int = 2  # a request whose replica fails before the first byte of its answer is retried this
    # many times on another replica

    page_size: int = 16  # tokens per KV page (a power of two for the Pallas kernel)
    num_pages: int = 0  # KV pages in the pool, page 0 (the null page) included; 0 = sized from device memory
    max_num_batched_tokens: int = 256  # token budget of one step (the largest token bucket)
    max_num_seqs: int = 0  # sequences running at once (the largest slot bucket); 0 = sized from the pool
    # share of the device's memory the engine may fill (weights, KV pool, a step's activations) when num_pages = 0
    memory_utilization: float = 0.9
    max_model_len: int = 0  # prompt + output tokens of one request; 0 = model.max_seq_len
    min_token_bucket: int = 16  # smallest token bucket; buckets double up to max_num_batched_tokens
    min_slot_bucket: int = 1  # fewest slots of a step shape: t padded tokens get min(max(t, this), max_num_seqs)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # cap on one request's prefill chunk per step; 0 = the budget alone
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8", "fp8"] = "auto"  # auto = compute dtype;
    # int8 / fp8 (e4m3): quantized pool with a scale per token and kv head (mmjax.kernels.kv_pages)
    quantization: Literal["none", "int8", "fp8", "int4"] = "none"  # decoder matmul weights (mmjax.quant), at load
    quantize_lm_head: bool = False  # the output matmul (tied embedding table or lm_head) in int8 per vocabulary row
    # int4: contracted values per scale; it must divide every decoder matmul's contraction (64 for a hidden size
    # of 576, e.g. SmolLM2-135M); a multiple of 128 keeps the packed layout and the fused decode kernel
    quant_group: int = 128
    image_cache_size: int = 64  # encoded images kept (LRU by content hash) so a repeated image is encoded once
    # most top logprobs a request may ask for (a call with such a request or a beam search computes this many, or
    # 2 * max_beam_width if more; a call without one computes none)
    max_logprobs: int = 5
    seed: int = 0  # draws the sampling seed of each request that gives none, so a run is reproducible
    max_beam_width: int = 4  # most beams a beam-search request may ask for (the step returns 2x this many candidates)
    # > 1: when every running request is decoding (and no waiting request can be admitted; with mixed_decode_steps
    # also in calls that prefill), run this many decode steps in one device call (tokens fed back on device; the
    # host's per-step work is paid once per call; outputs come k at a time, a stream still sends a chunk per token);
    # 0 = by backend: 8 on a GPU or TPU, 1 on the CPU (serving.buckets.auto_decode_steps)
    decode_steps: int = 0
    # with decode_steps > 1: a call that prefills (a prompt's chunk, an admitted request) also runs decode_steps - 1
    # more decode steps for the requests decoding after its ragged step (docs/serving.md, "Mixed calls")
    mixed_decode_steps: bool = True
    overlap_decode: bool = True  # with decode_steps > 1: launch the next multi-step call before reading the current
    # one's tokens (the host's work between calls overlaps the device's; see Scheduler.schedule_chained)
    # with decode_steps = 1: launch step N+1 before step N's tokens reach the host, its inputs fed from N's samples
    # on the device; the host reconciles stops one step behind (docs/serving.md, "Overlapped scheduling")
    async_scheduling: bool = True
    # make each device call (the jitted step: argument handling, enqueueing its kernels) on a launcher thread, so
    # the engine's Python work for the step before (reading, reporting) and the next one runs meanwhile
    launch_thread: bool = False
    # run the layers unrolled over per-layer weights (a scanned checkpoint is converted once at start-up); a scan
    # over stacked weights copies each layer's weights every step (mmjax.serving.unroll; docs/serving.md)
    unroll_layers: bool = True
    speculative: SpeculativeConfig = SpeculativeConfig()

    def validate(self, cfg: Config) -> None:
        self.check(cfg.model.max_seq_len)

    def check(self, model_max_len: int) -> None:
        """serve.* ranges, for a model of `model_max_len` (the engine calls this for a ServeConfig built in code)."""
        for name in ("page_size", "max_num_batched_tokens", "min_token_bucket", "min_slot_bucket", "image_cache_size"):
            need(getattr(self, name) >= 1, f"serve.{name} must be >= 1, got {getattr(self, name)}")
        need(self.page_size & (self.page_size - 1) == 0, f"serve.page_size={self.page_size} must be a power of two")
        need(self.num_pages == 0 or self.num_pages >= 2,
             f"serve.num_pages={self.num_pages} must be 0 (sized from device memory) or >= 2 (page 0 is the "
             "reserved null page)")
        need(self.max_num_seqs >= 0, f"serve.max_num_seqs={self.max_num_seqs} must be >= 1, or 0 (sized from the pool)")
        need(self.quant_group >= 2 and self.quant_group % 2 == 0,
             f"serve.quant_group={self.quant_group} must be an even number >= 2 (int4 values per scale)")
        need(0.0 < self.memory_utilization <= 1.0,
             f"serve.memory_utilization={self.memory_utilization} must be in (0, 1]")
        need(self.max_model_len == 0 or self.max_model_len >= 2,
             f"serve.max_model_len={self.max_model_len} must be 0 (= model.max_seq_len) or >= 2")
        need(self.max_model_len <= model_max_len,
             f"serve.max_model_len={self.max_model_len} exceeds model.max_seq_len={model_max_len}; lower it or use 0")
        need(self.long_prefill_token_threshold >= 0, "serve.long_prefill_token_threshold must be >= 0 (0 = off)")
        need(0 <= self.max_logprobs <= 20, f"serve.max_logprobs={self.max_logprobs} must be in [0, 20]")
        need(0 <= self.max_beam_width <= 16, f"serve.max_beam_width={self.max_beam_width} must be in [0, 16]")
        need(0 <= self.decode_steps <= 64,
             f"serve.decode_steps={self.decode_steps} must be in [1, 64], or 0 (by backend: 8 on an accelerator)")
        self.speculative.validate()
        need(self.max_num_seqs <= self.max_num_batched_tokens,
             f"serve.max_num_seqs={self.max_num_seqs} must be <= "
             f"serve.max_num_batched_tokens={self.max_num_batched_tokens} "
             "(each running sequence takes at least one token of a step)")
        need(0 <= self.port <= 65535, f"serve.port={self.port} must be in [0, 65535]")
        for name in ("token_budget", "max_queue_wait_s", "interactive_ttft_s", "drain_timeout_s",
                     "max_images_per_request"):
            need(getattr(self, name) >= 0, f"serve.{name} must be >= 0, got {getattr(self, name)}")
        need(self.max_queue_len >= 1, f"serve.max_queue_len={self.max_queue_len} must be >= 1 (the queue is bounded)")
        need(self.max_request_bytes >= 1024, f"serve.max_request_bytes={self.max_request_bytes} must be >= 1024")
        need(self.max_image_pixels >= 1, f"serve.max_image_pixels={self.max_image_pixels} must be >= 1")
        need(all(p.startswith("/") for p in self.public_paths),
             f"serve.public_paths={list(self.public_paths)}: every entry must be a path starting with /")
        need(self.replicas >= 0, f"serve.replicas={self.replicas} must be >= 0 (0 = one process without Ray)")
        need(self.max_replicas == 0 or 1 <= self.min_replicas <= self.max_replicas,
             f"serve.min_replicas={self.min_replicas} must be in [1, serve.max_replicas={self.max_replicas}]")
        need(self.max_replicas == 0 or self.min_replicas <= max(self.replicas, 1) <= self.max_replicas,
             f"serve.replicas={self.replicas} must be in [serve.min_replicas, serve.max_replicas] when autoscaling")
        need(self.target_ongoing_requests > 0, "serve.target_ongoing_requests must be > 0")
        need(min(self.replica_cpus, self.replica_gpus) >= 0, "serve.replica_cpus and serve.replica_gpus must be >= 0")
        need(self.router_block_chars >= 1, f"serve.router_block_chars={self.router_block_chars} must be >= 1")
        need(self.router_max_imbalance >= 0, "serve.router_max_imbalance must be >= 0")
        need(self.router_retries >= 0, "serve.router_retries must be >= 0")


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    parallel: ParallelConfig = ParallelConfig()
    distributed: DistributedConfig = DistributedConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    observe: ObserveConfig = ObserveConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    serve: ServeConfig = ServeConfig()

    def validate(self) -> None:
        """Every section checks itself (and the other sections' keys it depends on); the first failure names its key."""
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(self)


# ----------------------------------------------------------------------------------------------
# Loading


PACKAGED_CONFIGS = Path(__file__).resolve().parent / "configs"


def resolve_config_path(path: str | os.PathLike) -> Path:
    """An existing file as given, else the packaged config of that name (`tiny_shapes.yaml`,
    `models/llama_1b.yaml`, or the same with the repository's `mmjax/configs/` prefix), so the documented
    configs work from any directory and from a non-editable install."""
    given = Path(path)
    if given.is_file() or given.is_absolute():
        return given.resolve()
    name = given.as_posix()
    for prefix in ("mmjax/configs/", "configs/"):
        name = name.removeprefix(prefix)
    packaged = PACKAGED_CONFIGS / name
    return packaged.resolve() if packaged.is_file() else given.resolve()


def packaged_config_names() -> list[str]:
    return sorted(p.relative_to(PACKAGED_CONFIGS).as_posix() for p in PACKAGED_CONFIGS.rglob("*.yaml"))


def load_yaml_tree(path: str | os.PathLike, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML config and merge it over the file its `base:` key names (relative to it)."""
    path = resolve_config_path(path)
    if path in _seen:
        raise ConfigError(f"{path}: `base:` chain loops back to itself ({' -> '.join(map(str, _seen))})")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing file to --config or one of the "
                          f"packaged configs: {', '.join(packaged_config_names())}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(tree).__name__}")
    base = tree.pop("base", None)
    if base is None:
        return tree
    return deep_merge(load_yaml_tree(path.parent / base, _seen + (path,)), tree)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Apply one `a.b.c=value` override; the value is parsed as YAML (`1`, `true`, `[1,2]`, `0.5`)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} is not of the form section.key=value")
    dotted, raw = override.split("=", 1)
    keys = dotted.strip().split(".")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {key} is a value, not a section")
        node = child
    node[keys[-1]] = value


# a dotted override on a command line: `section.key=value` (the key has a dot; `name=...` values are not)
OVERRIDE_ARG = re.compile(r"^[A-Za-z_]\w*(\.\w+)+=")


def parse_cli(parser: argparse.ArgumentParser, argv: typing.Sequence[str]) -> argparse.Namespace:
    """`parser` over `argv` with the dotted overrides taken out first, wherever they stand, and returned in order
    as `args.overrides`: an option of several values (`--batches 1 8`) would otherwise take the overrides after
    it as its own values and fail on them. Options and other positionals may come in any order."""
    overrides = [a for a in argv if OVERRIDE_ARG.match(a)]
    args = parser.parse_intermixed_args([a for a in argv if not OVERRIDE_ARG.match(a)])
    args.overrides = [*(getattr(args, "overrides", None) or []), *overrides]
    return args


def from_tree(cls: type, tree: Any, prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, checking every key and value type."""
    if not isinstance(tree, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {tree!r}")
    fields = {_key(f): f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if name in REMOVED_KEYS:
            raise ConfigError(f"config key {name} was {REMOVED_KEYS[name]}")
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"unknown config key {name}{hint}")
        field_name = fields[key].name
        kwargs[field_name] = _coerce(hints[field_name], value, name)
    return cls(**kwargs)


def _key(field: dataclasses.Field) -> str:
    """The config key of a field: its name, or metadata["key"] where the key is a Python keyword (`async`)."""
    return field.metadata.get("key", field.name)


def _coerce(hint: Any, value: Any, name: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return from_tree(hint, value, f"{name}.")
    origin = typing.get_origin(hint)
    if origin is dict:
        if isinstance(value, str):  # data.storage_options was once a JSON string
            key = name.rsplit(".", 1)[-1]
            raise ConfigError(f"{name} must be a mapping, not the string {value!r}; write YAML ({key}: {{endpoint_url: "
                              f"http://host:9000}}) or {name}={{\"endpoint_url\": \"http://host:9000\"}}")
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{name} must be a mapping with string keys, got {value!r}")
        return dict(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list, got {value!r}")
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        return tuple(_coerce(item, v, name) for v in value)
    if origin is Literal:
        choices = typing.get_args(hint)
        if not any(value == c and type(value) is type(c) for c in choices):  # type: True is not 1
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            suggest = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"{name}={value!r} is not one of: {', '.join(map(str, choices))}{suggest}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            try:
                return _coerce(arg, value, name)
            except ConfigError:
                pass
        raise ConfigError(f"{name} has the wrong type: {value!r}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint is type(None):
        if value is not None:
            raise ConfigError(f"{name} must be null")
        return None
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(
            f"{name} must be {hint.__name__}, got {type(value).__name__} {value!r}"
            f"; write e.g. {name}={_example(hint)}"
        )
    return value


def _example(hint: type) -> str:
    return {int: "1", float: "0.5", bool: "true", str: "text"}.get(hint, "...")


def load_config(path: str | os.PathLike | typing.Sequence[str | os.PathLike] | None = None,
                overrides: typing.Sequence[str] = ()) -> Config:
    """Resolve YAML + overrides into a validated `Config`.

    `path` may be a list: later files merge over earlier ones (e.g. an experiment, then a
    `parallel/*.yaml` layout preset); names resolve as in `resolve_config_path`.
    """
    paths = [] if not path else [path] if isinstance(path, (str, os.PathLike)) else list(path)
    tree: dict[str, Any] = {}
    for p in paths:
        tree = deep_merge(tree, load_yaml_tree(p))
    for override in overrides:
        apply_override(tree, override)
    cfg = from_tree(Config, tree)
    validate(cfg)
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) for YAML/JSON output."""

    def plain(x: Any) -> Any:
        if dataclasses.is_dataclass(x):
            return {_key(f): plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, tuple):
            return [plain(v) for v in x]
        return x

    return plain(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


# ----------------------------------------------------------------------------------------------
# Validation: each section's `validate` above; the device count is checked in mmjax.parallel.mesh, kernel choices
# where the model is built (mmjax.model.kernel_choices), a pipeline plan in mmjax.training.pipeline.


def validate(cfg: Config) -> None:
    """`cfg.validate()`: one line naming the first bad key, as a `ConfigError`."""
    cfg.validate()


def validate_buckets(cfg: Config) -> None:
    """data.buckets / data.image_buckets: shapes the model can take, aligned, and a supported combination."""
    d, s = cfg.data, cfg.model.max_seq_len
    if d.buckets == () and d.image_buckets == ():
        return
    if isinstance(d.buckets, str) and d.buckets != "auto":
        raise ConfigError(f"data.buckets={d.buckets!r} must be a list of row lengths, e.g. [512, 1024], or auto")
    if d.bucket_align < 1 or d.bucket_align % d.pad_to_multiple:
        raise ConfigError(f"data.bucket_align={d.bucket_align} must be a positive multiple of "
                          f"data.pad_to_multiple={d.pad_to_multiple}")
    for b in () if isinstance(d.buckets, str) else d.buckets:
        if not 0 < b <= s:
            raise ConfigError(f"data.buckets entry {b} must be within 1..model.max_seq_len={s}; drop it (the "
                              "longest bucket is always model.max_seq_len)")
        if b % d.bucket_align and b != s:
            raise ConfigError(f"data.buckets entry {b} is not a multiple of data.bucket_align={d.bucket_align}; "
                              f"use {-(-b // d.bucket_align) * d.bucket_align} or set data.bucket_align")
    sp = cfg.mesh.sequence
    if sp > 1 and d.bucket_align % sp:
        raise ConfigError(f"data.bucket_align={d.bucket_align} is not divisible by mesh.sequence={sp} (each "
                          f"bucket's rows are split over it); use a multiple of {sp}")
    if d.buckets == "auto" and d.num_auto_buckets < 1:
        raise ConfigError(f"data.num_auto_buckets={d.num_auto_buckets} must be >= 1")
    for n in d.image_buckets:
        if not 1 <= n <= d.max_images:
            raise ConfigError(f"data.image_buckets entry {n} must be within 1..data.max_images={d.max_images} "
                              "(a batch always has at least one image slot)")
    if d.bucket_max_wait < 1:
        raise ConfigError(f"data.bucket_max_wait={d.bucket_max_wait} must be >= 1 (batches)")
    if cfg.model.text_only and d.image_buckets:
        raise ConfigError("data.image_buckets needs a vision tower; model.text_only=true takes no images")
