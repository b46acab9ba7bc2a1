"""One compiled train step per batch shape: warm-up compiles every announced bucket, calls compile nothing."""

import logging

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.training.compiled import CompiledSteps


def test_warm_up_compiles_every_announced_shape_once(caplog):
    traces = []

    def step(state, batch):
        traces.append(batch["tokens"].shape)
        return state + jnp.sum(batch["tokens"]), {"n": batch["tokens"].shape[1]}

    steps = CompiledSteps(jax.jit(step, donate_argnums=0))
    state = jnp.zeros((), jnp.int32)
    first = {"tokens": jnp.ones((2, 16), jnp.int32)}
    announced = [{"tokens": ((2, s), np.dtype(np.int32))} for s in (16, 32, 64)]
    steps.warm_up(state, first, announced)
    assert steps.count == 3 and traces == [(2, 16), (2, 32), (2, 64)]
    for s in (32, 16, 64, 32):
        state, metrics = steps(state, {"tokens": jnp.ones((2, s), jnp.int32)})
        assert metrics["n"] == s
    assert steps.count == 3 and len(traces) == 3 and int(state) == 2 * (32 + 16 + 64 + 32)
    with caplog.at_level(logging.WARNING, logger="mmjax.training.compiled"):
        steps(state, {"tokens": jnp.ones((2, 8), jnp.int32)})  # not announced: compiled, and said so
    assert steps.count == 4 and "did not announce" in caplog.text
