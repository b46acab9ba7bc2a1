"""Every mesh layout gives one device's numbers: one train step's loss and updated params (float32).

One tiny model (mmjax/configs/models/tiny_mllm.yaml dims), one synthetic packed multimodal batch, one
compile per layout. Also checks how much of the state each device holds under fsdp=8 and tensor=4.
"""

import re

import jax
import numpy as np
import pytest

from mmjax.config import load_config
from mmjax.parallel.mesh import make_mesh
from mmjax.parallel.rules import addressable_fraction
from mmjax.parallel.sharding import context_from_config, in_sharding_context
from mmjax.training.feed import to_global_batch
from mmjax.training.init import create_train_state, model_setup, state_shardings
from mmjax.training.optimizer import learning_rate_schedule, make_optimizer
from mmjax.training.steps import make_train_step

IMAGE_ID = 3
MODEL = "mmjax/configs/models/tiny_mllm.yaml"
# eps=1 keeps Adam's first update ~linear in the gradient, so matching params means matching gradients
BASE = ["model.compute_dtype=float32", "train.global_batch_size=8", "optim.warmup_steps=0",
        "optim.schedule=constant", "optim.lr=1.0", "optim.eps=1.0", "train.steps=1"]

LAYOUTS = {
    "fsdp8": ["mesh.data=1", "mesh.fsdp=8"],
    "data2_fsdp4": ["mesh.data=2", "mesh.fsdp=4"],
    "data2_fsdp2_tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    "tensor4_fsdp2": ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4"],
    "tensor2_sequence_parallel": ["mesh.data=4", "mesh.tensor=2", "parallel.sequence_parallel=true"],
    "sequence4_allgather": ["mesh.data=2", "mesh.sequence=4", "parallel.context_parallel=allgather"],
    "sequence4_ring": ["mesh.data=2", "mesh.sequence=4", "parallel.context_parallel=ring"],
    "fsdp2_tensor2_sequence2_ring": ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "mesh.sequence=2",
                                     "parallel.context_parallel=ring"],
    "zero1_data8": ["mesh.data=8", "parallel.zero_stage=1"],
    "zero2_data2_fsdp4_accum2": ["mesh.data=2", "mesh.fsdp=4", "parallel.zero_stage=2",
                                "train.global_batch_size=16", "train.grad_accum_steps=2"],
}


def make_batch(cfg, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Packed rows: segment 1 = an image (T placeholders) + text, segment 2 = text, then padding."""
    rng = np.random.default_rng(seed)
    s, t, v = cfg.model.max_seq_len, cfg.model.image_tokens, cfg.model.vision
    tokens = rng.integers(4, cfg.model.vocab_size, (rows, s)).astype(np.int32)
    seg = np.zeros((rows, s), np.int32)
    pos = np.zeros((rows, s), np.int32)
    image_valid = np.zeros((rows, 1), bool)
    for r in range(rows):
        a = int(rng.integers(s // 3, s // 2 + 8))
        b = int(rng.integers(a + 4, s - 2))
        seg[r, :a], seg[r, a:b] = 1, 2
        pos[r, :a], pos[r, a:b] = np.arange(a), np.arange(b - a)
        if r % 4 != 3:  # every fourth row has no image
            tokens[r, 2:2 + t] = IMAGE_ID
            image_valid[r, 0] = True
    images = rng.normal(size=(rows, 1, v.image_size, v.image_size, v.channels)).astype(np.float32)
    targets = rng.integers(0, cfg.model.vocab_size, (rows, s)).astype(np.int32)
    loss_mask = ((seg > 0) & (tokens != IMAGE_ID)).astype(np.float32)
    return dict(tokens=tokens, targets=targets, loss_mask=loss_mask, segment_ids=seg, positions=pos,
                images=images, image_valid=image_valid)




def one_step(overrides, devices=None, initial=None):
    """(state before, state after, metrics) of one train step; `initial` (host state) skips creation."""
    cfg = load_config(MODEL, BASE + overrides)
    mesh = make_mesh(cfg, devices)
    setup = model_setup(cfg, mesh, IMAGE_ID)
    optimizer = make_optimizer(cfg)
    if initial is None:
        state, shardings = create_train_state(cfg, mesh, setup, optimizer)
    else:  # the same initial values, laid out for this mesh (creation itself is tested below)
        shardings = state_shardings(mesh, setup, optimizer, initial)
        state = jax.device_put(initial, shardings)
    step = make_train_step(setup.graphdef, optimizer, learning_rate_schedule(cfg), cfg.train.grad_accum_steps,
                           grad_shardings=setup.plan.grads)
    step = jax.jit(in_sharding_context(step, context_from_config(cfg, mesh)), out_shardings=(shardings, None))
    batch = to_global_batch(make_batch(cfg, cfg.train.global_batch_size), mesh)
    compiled = step.lower(state, batch).compile()
    new_state, metrics = compiled(state, batch)
    one_step.hlo = compiled.as_text()
    return state, new_state, jax.device_get(metrics)


COLLECTIVE = re.compile(r"= \w+\[([\d,]*)\][^ ]* (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)")


def collective_shapes(hlo: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in m.group(1).split(",") if d) for m in COLLECTIVE.finditer(hlo)]


@pytest.fixture(scope="module")
def reference():
    """One-device runs (per global batch size): initial host state, updated params, metrics."""
    out = {}

    def get(global_batch):
        if global_batch not in out:
            old, new, metrics = one_step(["mesh.data=1", f"train.global_batch_size={global_batch}"],
                                         jax.devices()[:1])
            out[global_batch] = (jax.device_get(old), jax.device_get(new.params), metrics)
        return out[global_batch]

    return get


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_device(name, reference):
    overrides = LAYOUTS[name]
    gbs = load_config(MODEL, BASE + overrides).train.global_batch_size
    initial, ref_params, ref_metrics = reference(gbs)
    old, new, metrics = one_step(overrides, initial=initial)
    assert abs(metrics["train/loss"] - ref_metrics["train/loss"]) <= 1e-5 * abs(ref_metrics["train/loss"])
    assert abs(metrics["train/grad_norm"] - ref_metrics["train/grad_norm"]) <= 1e-5 * ref_metrics["train/grad_norm"]
    params = jax.device_get(new.params)
    paths = jax.tree_util.tree_leaves_with_path(params)
    for (path, got), want in zip(paths, jax.tree.leaves(ref_params), strict=True):
        assert rel_err(got, want) <= 1e-5, (jax.tree_util.keystr(path), rel_err(got, want))
    if load_config(MODEL, BASE + overrides).mesh.tensor > 1:
        # vocab-parallel embedding, output projection and loss: nothing vocab-sized (the [B,S,V] logits, or
        # the [V,E] table) is ever gathered; only [B,S] softmax statistics are all-reduced
        vocab = load_config(MODEL, BASE).model.vocab_size
        shapes = collective_shapes(one_step.hlo)
        assert shapes and not [sh for sh in shapes if vocab in sh]
    # the step really moved the parameters (the comparison above is not of two initial states)
    moved = [float(np.max(np.abs(a - b)))
             for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(jax.device_get(old.params)))]
    assert max(moved) > 1e-3


def test_unrolled_layers_partition_like_one_device():
    """`model.scan_layers=false` (each layer one jitted function, called per layer) under data x fsdp x tensor:
    the same loss, gradient norm and updated parameters as on one device."""
    unrolled = ["model.scan_layers=false"]
    old, ref, ref_metrics = one_step(unrolled + ["mesh.data=1"], jax.devices()[:1])
    _, new, metrics = one_step(unrolled + LAYOUTS["data2_fsdp2_tensor2"], initial=jax.device_get(old))
    assert abs(metrics["train/loss"] - ref_metrics["train/loss"]) <= 1e-5 * abs(ref_metrics["train/loss"])
    assert abs(metrics["train/grad_norm"] - ref_metrics["train/grad_norm"]) <= 1e-5 * ref_metrics["train/grad_norm"]
    paths = jax.tree_util.tree_leaves_with_path(jax.device_get(new.params))
    assert any("layers" in jax.tree_util.keystr(p) and "[0]" in jax.tree_util.keystr(p) for p, _ in paths)  # unrolled
    for (path, got), want in zip(paths, jax.tree.leaves(jax.device_get(ref.params)), strict=True):
        assert rel_err(got, want) <= 1e-5, (jax.tree_util.keystr(path), rel_err(got, want))


def shard_fraction(tree) -> float:
    leaves = [x for x in jax.tree.leaves(tree) if x.ndim > 0]
    held = sum(np.prod(x.addressable_shards[0].data.shape) for x in leaves)
    return float(held) / sum(x.size for x in leaves)


def test_fsdp8_holds_an_eighth_of_params_and_optimizer_state():
    cfg = load_config(MODEL, BASE + LAYOUTS["fsdp8"])
    mesh = make_mesh(cfg)
    setup = model_setup(cfg, mesh, IMAGE_ID)
    state, _ = create_train_state(cfg, mesh, setup, make_optimizer(cfg))
    assert 1 / 8 <= shard_fraction(state.params) < 0.13
    assert 1 / 8 <= shard_fraction(state.opt_state) < 0.13
    for x in jax.tree.leaves(state.params):  # every weight matrix is split 8 ways (biases may not be)
        if x.size >= 4096:
            assert addressable_fraction(x) == pytest.approx(1 / 8)


def test_tensor4_splits_attention_and_mlp_weights_four_ways():
    cfg = load_config(MODEL, BASE + ["mesh.data=2", "mesh.tensor=4"])
    mesh = make_mesh(cfg)
    params = model_setup(cfg, mesh, IMAGE_ID).make_params()
    text, vision = cfg.model.text, cfg.model.vision
    dec, vis = params["decoder"]["layers"], params["vision"]["layers"]
    # [layers, ...] shapes per device: the heads / kv_heads / mlp dimension is a quarter
    assert dec["qkv"].addressable_shards[0].data.shape[2] == text.n_kv_heads // 4
    assert dec["out"].addressable_shards[0].data.shape[1] == text.n_heads // 4
    assert dec["gate_up"].addressable_shards[0].data.shape[3] == text.mlp_dim // 4
    assert dec["down"].addressable_shards[0].data.shape[1] == text.mlp_dim // 4
    assert vis["qkv"].addressable_shards[0].data.shape[3] == vision.n_heads // 4
    assert vis["fc1"].addressable_shards[0].data.shape[2] == vision.mlp_dim // 4
    assert params["decoder"]["embedding"].addressable_shards[0].data.shape[0] == cfg.model.vocab_size // 4
    for w in (dec["qkv"], dec["out"], dec["gate_up"], dec["down"], vis["qkv"], vis["out"], vis["fc1"], vis["fc2"]):
        assert addressable_fraction(w) == pytest.approx(1 / 4)


def test_zero1_shards_optimizer_state_but_not_params():
    cfg = load_config(MODEL, BASE + LAYOUTS["zero1_data8"])
    mesh = make_mesh(cfg)
    setup = model_setup(cfg, mesh, IMAGE_ID)
    state, _ = create_train_state(cfg, mesh, setup, make_optimizer(cfg))
    assert shard_fraction(state.params) == 1.0
    assert shard_fraction(state.opt_state) < 0.15
