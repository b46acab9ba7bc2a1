import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.config import load_config
from mmjax.training.optimizer import learning_rate_schedule, make_optimizer
from mmjax.training.precision import initial_loss_scale


@pytest.mark.parametrize("schedule", ["cosine", "polynomial", "constant"])
def test_schedule_warmup_peak_and_end(schedule):
    cfg = load_config(None, ["train.steps=100", "optim.warmup_steps=10", "optim.lr=1.0",
                             "optim.min_lr_ratio=0.1", f"optim.schedule={schedule}"])
    lr = learning_rate_schedule(cfg)
    assert float(lr(0)) == pytest.approx(0.1)  # first step already learns
    assert float(lr(9)) < 1.0 and float(lr(10)) == pytest.approx(1.0)
    expected_end = 1.0 if schedule == "constant" else 0.1
    assert float(lr(100)) == pytest.approx(expected_end, rel=1e-5)
    values = [float(lr(s)) for s in range(10, 101)]
    assert all(a >= b - 1e-7 for a, b in zip(values, values[1:]))  # non-increasing after warmup


def test_schedule_steps_decouples_schedule_from_run_length():
    short = learning_rate_schedule(load_config(None, ["train.steps=50", "optim.schedule_steps=100"]))
    long = learning_rate_schedule(load_config(None, ["train.steps=100"]))
    for s in (0, 25, 50, 99):
        assert float(short(s)) == pytest.approx(float(long(s)))


def test_weight_decay_only_on_matrices():
    cfg = load_config(None, ["optim.lr=1.0", "optim.weight_decay=0.5", "optim.warmup_steps=0",
                             "optim.schedule=constant"])
    opt = make_optimizer(cfg)
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones((2,))}
    state = opt.init(params)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zero, state, params)
    np.testing.assert_allclose(updates["w"], -0.5 * np.ones((2, 2)), rtol=1e-6)  # decayed
    np.testing.assert_allclose(updates["b"], 0.0)  # not decayed


@pytest.mark.parametrize("fused", [False, True])
def test_scanned_and_unrolled_layers_decay_the_same_parameters(fused):
    """A stacked layer stack's [layers, dim] norm scale is a vector per layer, not a matrix: like the unrolled
    stack's [dim] scales it is not decayed, while its [layers, dim, dim] weights are."""
    cfg = load_config(None, ["optim.lr=1.0", "optim.weight_decay=0.5", "optim.warmup_steps=0",
                             "optim.schedule=constant", f"optim.fused={str(fused).lower()}"])
    layer = lambda lead: {"attn": {"wq": jnp.ones((*lead, 2, 2))}, "norm": {"scale": jnp.ones((*lead, 2))}}
    scanned = {"decoder": {"layers": layer((3,)), "embedding": jnp.ones((4, 2)), "norm": {"scale": jnp.ones(2)}}}
    unrolled = {"decoder": {"layers": {str(i): layer(()) for i in range(3)}, "embedding": jnp.ones((4, 2)),
                            "norm": {"scale": jnp.ones(2)}}}
    moved = []
    for params in (scanned, unrolled):
        opt = make_optimizer(cfg)
        updates, _ = opt.update(jax.tree.map(jnp.zeros_like, params), opt.init(params), params)
        moved.append(updates)
    s, u = moved
    np.testing.assert_allclose(s["decoder"]["layers"]["attn"]["wq"], -0.5, rtol=1e-6)
    np.testing.assert_allclose(s["decoder"]["layers"]["norm"]["scale"], 0.0)
    for i in range(3):
        np.testing.assert_allclose(u["decoder"]["layers"][str(i)]["attn"]["wq"], -0.5, rtol=1e-6)
        np.testing.assert_allclose(u["decoder"]["layers"][str(i)]["norm"]["scale"], 0.0)
    for tree in moved:
        np.testing.assert_allclose(tree["decoder"]["embedding"], -0.5, rtol=1e-6)
        np.testing.assert_allclose(tree["decoder"]["norm"]["scale"], 0.0)


def test_fp16_loss_scale_backs_off_on_overflow_and_grows():
    cfg = load_config(None, ["optim.loss_scale_init=1024", "optim.loss_scale_growth_interval=3"])
    ls = initial_loss_scale(cfg, jnp.float16)
    assert ls.dynamic and float(ls.scale) == 1024
    ls = ls.update(jnp.asarray(False))
    assert float(ls.scale) == 512 and int(ls.skipped) == 1 and int(ls.good_steps) == 0
    for _ in range(3):
        ls = ls.update(jnp.asarray(True))
    assert float(ls.scale) == 1024 and int(ls.good_steps) == 0 and int(ls.skipped) == 1
    off = initial_loss_scale(cfg, jnp.bfloat16)
    assert not off.dynamic and float(off.update(jnp.asarray(True)).scale) == 1.0
