"""MLLM: axes, init, masking (causal / packed / image blocks), merge, scan vs loop, remat."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mmjax.errors import ConfigError, ModelError
from mmjax.model import MLLM, logical_axes, resolve_dtype
from mmjax.model.layers import params_in_layout

KNOWN_AXES = {"layers", "vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", None}


def test_init_and_logical_axes(helpers):
    cfg = helpers["tiny_config"]()
    # rbg keys: threefry compiles one slow CPU kernel per parameter shape.
    model = MLLM(cfg, image_token_id=helpers["image_token"], rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
    params = nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(params)
    assert len(flat) > 20
    for path, var in flat:
        names = var.get_metadata().get("out_sharding")
        assert isinstance(names, tuple) and len(names) == var.ndim, (path, names, var.shape)
        assert set(names) <= KNOWN_AXES, (path, names)
        assert ("layers" in path) == (names[0] == "layers"), (path, names)
        assert var.dtype == jnp.float32
        value = np.asarray(var[...])
        leaf = path[-1]
        if leaf == "scale":
            assert np.all(value == 1), path
        elif "bias" in leaf:
            assert np.all(value == 0), path
        else:
            assert abs(value.std() - 0.02) < 0.005, (path, value.std())
    # the exact layouts the parallel rules rely on
    t = cfg.text
    g = t.n_heads // t.n_kv_heads
    qkv = model.decoder.layers.qkv
    assert qkv.shape == (t.n_layers, t.dim, t.n_kv_heads, g + 2, t.resolved_head_dim)
    assert qkv.get_metadata()["out_sharding"] == ("layers", "embed", "kv_heads", None, "head_dim")
    assert model.decoder.layers.out.get_metadata()["out_sharding"] == ("layers", "heads", "head_dim", "embed")
    assert model.decoder.layers.gate_up.get_metadata()["out_sharding"] == ("layers", "embed", None, "mlp")
    assert model.decoder.embedding.get_metadata()["out_sharding"] == ("vocab", "embed")
    # extraction: PartitionSpecs of logical names, and plain tuples
    specs = nnx.get_partition_spec(params)
    assert specs["decoder"]["layers"]["qkv"].get_value() == jax.sharding.PartitionSpec(
        "layers", "embed", "kv_heads", None, "head_dim")
    axes = logical_axes(params)
    assert axes["decoder"]["embedding"] == ("vocab", "embed")


def test_untied_head_and_loop_axes(helpers):
    cfg = helpers["tiny_config"](scan_layers=False, text=helpers["tiny_config"]().text.__class__(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=1, mlp_dim=48, tie_embeddings=False))
    model = helpers["random_model"](cfg)
    assert model.decoder.lm_head.get_metadata()["out_sharding"] == ("embed", "vocab")
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = var.get_metadata()["out_sharding"]
        assert len(names) == var.ndim and "layers" not in names, path
    out = helpers["forward"](model, helpers["make_batch"](cfg=cfg))
    assert out.shape == (2, 24, cfg.vocab_size) and out.dtype == np.float32 and np.all(np.isfinite(out))


def test_resolve_dtype():
    assert resolve_dtype("auto") == jnp.float32  # CPU
    assert resolve_dtype("bfloat16") == jnp.bfloat16
    with pytest.raises(ConfigError, match="unknown dtype 'float8'; choose one of auto, float32, bfloat16, float16"):
        resolve_dtype("float8")


def test_remat_policy_names_match_the_config():
    import typing

    from mmjax.config import RematPolicy
    from mmjax.model.layers import REMAT_POLICIES, remat

    assert tuple(REMAT_POLICIES) == typing.get_args(RematPolicy)
    with pytest.raises(ConfigError, match="model.remat='dot' is not one of: none, full, dots"):
        remat(lambda x: x, "dot")


def test_bad_inputs_raise_model_errors(helpers):
    """Inputs the config does not fit are ModelErrors (ConfigError for the config itself), raised while tracing."""
    cfg = helpers["tiny_config"]()
    with pytest.raises(ConfigError, match=r"image_token_id=64 is outside the vocabulary \[0, 64\)"):
        nnx.eval_shape(lambda: MLLM(cfg, image_token_id=64, rngs=nnx.Rngs(0)))
    model = helpers["random_model"](cfg)
    batch = {k: jnp.asarray(v) for k, v in helpers["make_batch"]().items()}
    text = (batch["tokens"], batch["positions"], batch["segment_ids"])
    wrong = jnp.zeros((2, 2, 4, 4, 3), jnp.float32)  # 4x4 images, the config says 8x8
    with pytest.raises(ModelError, match=r"images have shape \(2, 2, 4, 4, 3\), expected \[B, N, 8, 8, 3\]"):
        jax.eval_shape(lambda: model(*text, wrong, batch["image_valid"]))
    with pytest.raises(ModelError, match="needs `images` and `image_valid`"):
        jax.eval_shape(lambda: model(*text))


def test_causal_and_segments(helpers):
    cfg = helpers["tiny_config"]()
    model = helpers["random_model"](cfg, seed=1)
    fwd, mk = helpers["forward"], helpers["make_batch"]
    batch = mk(seed=2, images_at=((0, 2, 0),))
    # row 1 packs two segments: [0, 10) and [10, 24) with positions restarting
    batch["segment_ids"][1, 10:] = 2
    batch["positions"][1, 10:] = np.arange(14)
    base = fwd(model, batch)

    later = {k: v.copy() for k, v in batch.items()}
    later["tokens"][0, 15] = (later["tokens"][0, 15] + 1 - 4) % (cfg.vocab_size - 4) + 4
    out = fwd(model, later)
    np.testing.assert_array_equal(out[0, :15], base[0, :15])
    assert not np.allclose(out[0, 15:], base[0, 15:])
    np.testing.assert_array_equal(out[1], base[1])

    other_segment = {k: v.copy() for k, v in batch.items()}
    other_segment["tokens"][1, 3] = (other_segment["tokens"][1, 3] + 1 - 4) % (cfg.vocab_size - 4) + 4
    out = fwd(model, other_segment)
    np.testing.assert_array_equal(out[1, 10:], base[1, 10:])  # segment 2 unaffected (it comes later)
    assert not np.allclose(out[1, 3:10], base[1, 3:10])

    # identical segment content at another offset gives the same logits (positions restart)
    moved = {k: v.copy() for k, v in batch.items()}
    moved["tokens"][1, :10] = moved["tokens"][1, 10:20]
    out = fwd(model, moved)
    np.testing.assert_allclose(out[1, :10], out[1, 10:20], atol=1e-5)


def test_image_tokens_bidirectional(helpers):
    cfg = helpers["tiny_config"]()
    model = helpers["random_model"](cfg, seed=3)
    t = cfg.image_tokens
    batch = helpers["make_batch"](seed=4, images_at=((0, 5, 0), (1, 5, 0)))
    base = helpers["forward"](model, batch)
    changed = {k: v.copy() for k, v in batch.items()}
    p = cfg.vision.patch_size
    changed["images"][0, 0, -p:, -p:] += 1.0  # the image's last patch
    out = helpers["forward"](model, changed)
    np.testing.assert_array_equal(out[0, :5], base[0, :5])  # text before the image
    assert not np.allclose(out[0, 5], base[0, 5])  # first image token sees the last patch
    assert not np.allclose(out[0, 5 + t:], base[0, 5 + t:])
    np.testing.assert_array_equal(out[1], base[1])


def test_decoder_block_mask(helpers):
    """Isolate the decoder's block mask from the ViT's own mixing of patches."""
    cfg = helpers["tiny_config"]()
    decoder = helpers["random_model"](cfg, seed=5).decoder

    def dec(x, pos, seg, blk):
        return np.asarray(helpers["call"](decoder, "__call__", x, pos, seg,
                                          jnp.zeros_like(seg) if blk is None else blk))

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 12, cfg.text.dim)), jnp.float32)
    pos = jnp.arange(12, dtype=jnp.int32)[None]
    seg = jnp.ones((1, 12), jnp.int32)
    blk = jnp.zeros((1, 12), jnp.int32).at[0, 3:7].set(1).at[0, 7:9].set(2)
    x2 = x.at[0, 6].add(1.0)  # last token of block 1
    for block_ids, sees_later in [(blk, True), (None, False)]:
        a, b = dec(x, pos, seg, block_ids), dec(x2, pos, seg, block_ids)
        np.testing.assert_array_equal(a[0, :3], b[0, :3])
        assert (not np.allclose(a[0, 3], b[0, 3])) == sees_later
    a, b = dec(x, pos, seg, blk), dec(x.at[0, 8].add(1.0), pos, seg, blk)
    np.testing.assert_array_equal(a[0, :7], b[0, :7])  # block 1 does not see block 2
    assert not np.allclose(a[0, 7], b[0, 7])  # block 2's first token sees its second


def test_merge_places_images_in_order(helpers):
    cfg = helpers["tiny_config"]()
    model = helpers["random_model"](cfg, seed=6)
    t = cfg.image_tokens
    # row 0: images in slots 0 and 1; row 1: only slot 1 valid (slot 0 empty)
    batch = helpers["make_batch"](seed=7, images_at=((0, 1, 0), (0, 9, 1), (1, 4, 1)))
    x, blk = helpers["call"](model, "embed", jnp.asarray(batch["tokens"]), jnp.asarray(batch["images"]),
                             jnp.asarray(batch["image_valid"]))
    feats = helpers["call"](model.vision, "__call__", jnp.asarray(batch["images"]))
    feats = helpers["call"](model.projector, "__call__", feats)
    np.testing.assert_allclose(x[0, 1:1 + t], feats[0, 0], atol=1e-6)
    np.testing.assert_allclose(x[0, 9:9 + t], feats[0, 1], atol=1e-6)
    np.testing.assert_allclose(x[1, 4:4 + t], feats[1, 1], atol=1e-6)
    text = helpers["call"](model.decoder, "embed", jnp.asarray(batch["tokens"]))
    np.testing.assert_array_equal(x[0, 0], text[0, 0])
    np.testing.assert_array_equal(x[1, :4], text[1, :4])
    want = np.zeros_like(batch["tokens"])
    want[0, 1:1 + t], want[0, 9:9 + t], want[1, 4:4 + t] = 1, 2, 1
    np.testing.assert_array_equal(np.asarray(blk), want)


def test_scan_matches_loop(helpers):
    cfg = helpers["tiny_config"]()
    scan = helpers["random_model"](cfg, seed=8)
    loop = helpers["scan_to_loop"](scan, helpers["tiny_config"](scan_layers=False))
    batch = helpers["make_batch"](seed=9)
    np.testing.assert_allclose(helpers["forward"](scan, batch), helpers["forward"](loop, batch), atol=1e-6)
    # gradients too: the loop runs each layer as one jitted function called per layer (both towers)
    inputs = tuple(jnp.asarray(batch[k]) for k in helpers["batch_keys"])
    targets = jnp.asarray(np.roll(batch["tokens"], -1, axis=1))
    (ls, gs), (ll, gl) = _loss_and_grads(scan, inputs, targets), _loss_and_grads(loop, inputs, targets)
    np.testing.assert_allclose(ll, ls, rtol=1e-6)
    gl = params_in_layout(nnx.to_pure_dict(nnx.State(gl).filter(nnx.Param)), scan=True)
    gs = nnx.to_pure_dict(nnx.State(gs).filter(nnx.Param))
    for (path, a), (_, b) in zip(sorted(nnx.traversals.flatten_mapping(gs).items()),
                                 sorted(nnx.traversals.flatten_mapping(gl).items()), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=1e-5, err_msg=str(path))


def test_vision_tower_scans_over_unrolled_decoder_layers(helpers):
    """model.vision.scan_layers picks the tower's loop apart from the decoder's: stacked vision layers beside
    unrolled decoder layers, the same forward as both scanned."""
    cfg = helpers["tiny_config"]()
    scan = helpers["random_model"](cfg, seed=8)
    mixed_cfg = helpers["tiny_config"](scan_layers=False, vision=dataclasses.replace(cfg.vision, scan_layers=True))
    assert mixed_cfg.layer_layout == {"decoder": False, "vision": True}
    mixed = helpers["scan_to_loop"](scan, mixed_cfg)
    params = nnx.to_pure_dict(nnx.state(mixed, nnx.Param))
    assert set(params["decoder"]["layers"]) == {0, 1} and "attn_norm" in params["vision"]["layers"]
    batch = helpers["make_batch"](seed=9)
    np.testing.assert_allclose(helpers["forward"](scan, batch), helpers["forward"](mixed, batch), atol=1e-6)


def _loss_and_grads(module, inputs, targets):
    """Cross-entropy of module(*inputs) against integer targets, or mean square if targets is None."""
    graphdef, state = nnx.split(module)

    def loss(state):
        out = nnx.merge(graphdef, state)(*inputs)
        if targets is None:
            return jnp.mean(jnp.square(out))
        return optax.softmax_cross_entropy_with_integer_labels(out, targets).mean()

    return jax.jit(jax.value_and_grad(loss))(state)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_remat_policies_same_loss_and_grads(helpers, scan_layers):
    """Remat lives in the shared layer-stack helper (decoder and ViT); checked through the decoder."""
    policies = ["none", "full", "dots", "dots_no_batch", "save_attention_out"] if scan_layers else ["none", "full"]
    base = helpers["random_model"](helpers["tiny_config"](), seed=10)
    rng = np.random.default_rng(0)
    b, s, dim = 2, 12, base.cfg.text.dim
    seg = np.ones((b, s), np.int32)
    seg[1, 5:] = 2
    pos = np.concatenate([np.arange(s)[None], np.concatenate([np.arange(5), np.arange(s - 5)])[None]])
    blk = np.zeros((b, s), np.int32)
    blk[0, 2:6] = 1
    inputs = (jnp.asarray(rng.standard_normal((b, s, dim)), jnp.float32), jnp.asarray(pos, jnp.int32),
              jnp.asarray(seg), jnp.asarray(blk))
    targets = jnp.asarray(rng.integers(0, base.cfg.vocab_size, (b, s)))
    results = []
    for policy in policies:
        cfg = helpers["tiny_config"](remat=policy, scan_layers=scan_layers)
        model = helpers["random_model"](cfg, seed=10) if scan_layers else helpers["scan_to_loop"](base, cfg)
        results.append(_loss_and_grads(model.decoder, inputs, targets))
    loss0, grads0 = results[0]
    assert np.isfinite(float(loss0))
    for policy, (loss, grads) in zip(policies[1:], results[1:]):
        np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-6, err_msg=policy)
        for a, b_ in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=1e-6, rtol=1e-5, err_msg=policy)
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads0))


def _primitives(jaxpr) -> set[str]:
    """Every primitive's name in `jaxpr` and its sub-jaxprs (scan bodies, custom-vjp calls)."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(sub, (Jaxpr, ClosedJaxpr)):
                    names |= _primitives(getattr(sub, "jaxpr", sub))
    return names


@pytest.mark.parametrize("policy,named", [("none", False), ("full", False), ("save_attention_out", True)])
def test_attention_output_is_named_only_for_a_policy_that_saves_by_name(helpers, policy, named):
    """The residual name is an identity: under a policy that ignores names, the backward would save its output
    beside the attention's own residual (the same values twice per layer); so it exists only where it is used."""
    model = helpers["random_model"](helpers["tiny_config"](remat=policy), seed=10)
    graphdef, state = nnx.split(model.decoder)
    x = jnp.zeros((1, 8, model.cfg.text.dim), jnp.float32)
    pos, seg = jnp.arange(8)[None], jnp.ones((1, 8), jnp.int32)

    def loss(state):
        return jnp.sum(nnx.merge(graphdef, state)._layers(x, pos, seg, None))

    assert ("name" in _primitives(jax.make_jaxpr(jax.grad(loss))(state).jaxpr)) == named


def test_vision_remat_grads(helpers):
    """The ViT goes through the same stack helper; check its grads under remat too."""
    images = jnp.asarray(helpers["make_batch"](seed=11)["images"])
    results = [_loss_and_grads(helpers["random_model"](helpers["tiny_config"](remat=p), seed=12).vision,
                               (images,), None) for p in ("none", "full")]
    (l0, g0), (l1, g1) = results
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    for a, b_ in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=1e-6, rtol=1e-5)
    assert float(jnp.abs(g0["layers"]["qkv"][...]).max()) > 0


def test_sincos2d_separates_patches_more_at_low_temperature():
    """Every patch of a 3x3 grid gets its own code; at the ViT default temperature (10000) most dims barely
    change across so small a grid, which is why the tiny config lowers it."""
    from mmjax.model.vision import sincos2d

    def min_distance(pos):
        d = np.linalg.norm(pos[:, None] - pos[None], axis=-1)
        return d[~np.eye(len(pos), dtype=bool)].min()

    wide, narrow = np.asarray(sincos2d(3, 128, 10000.0)), np.asarray(sincos2d(3, 128, 3.0))
    assert wide.shape == narrow.shape == (9, 128)
    np.testing.assert_allclose(wide[4, [0, 64]], [np.sin(1.0), np.sin(1.0)], rtol=1e-6)  # centre cell: x = y = 1
    assert min_distance(wide) > 0
    assert min_distance(narrow) > 2 * min_distance(wide)


def test_projector_position_table_is_added_per_image_token(helpers):
    """model.projector.pos_embed=learned: image token k of every image reaches the decoder shifted by table
    row k (the patch's place, in the decoder's space); text tokens are untouched."""
    import dataclasses

    from mmjax.config import ProjectorConfig

    cfg = dataclasses.replace(helpers["tiny_config"](), projector=ProjectorConfig(pos_embed="learned"))
    model = helpers["random_model"](cfg)
    t = cfg.image_tokens
    images = jnp.asarray(np.random.default_rng(0).standard_normal((1, 2, 8, 8, 3)), jnp.float32)
    img, text = helpers["image_token"], [helpers["image_token"] + k for k in (1, 2, 3)]
    tokens = jnp.asarray([[text[0]] + [img] * t + [text[1]] + [img] * t + [text[2]]], jnp.int32)
    x, _ = model.embed(tokens, images, jnp.ones((1, 2), bool))
    table = np.asarray(model.projector.pos_embed[...])
    assert table.shape == (t, cfg.text.dim) and np.abs(table).max() > 0
    model.projector.pos_embed[...] = jnp.zeros_like(model.projector.pos_embed[...])
    x0, _ = model.embed(tokens, images, jnp.ones((1, 2), bool))
    diff = np.asarray(x - x0)[0]
    np.testing.assert_allclose(diff[1:1 + t], table, atol=1e-5)
    np.testing.assert_allclose(diff[2 + t:2 + 2 * t], table, atol=1e-5)
    np.testing.assert_array_equal(diff[[0, 1 + t, 2 + 2 * t]], 0)
