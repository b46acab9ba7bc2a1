"""Mixed-precision policy: compute dtype, and dynamic loss scaling for float16.

bfloat16 has float32's exponent range and needs no scaling. float16 gradients underflow, so the loss
is multiplied by `scale` before differentiation; a step whose gradients overflow is skipped and the
scale halved, and after `growth_interval` clean steps the scale doubles.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from mmjax.config import Config


@flax.struct.dataclass
class LossScale:
    scale: jax.Array  # float32 scalar; 1.0 and never changed when scaling is off
    good_steps: jax.Array  # int32: clean steps since the last change
    skipped: jax.Array  # int32: overflowing steps skipped so far
    growth_interval: int = flax.struct.field(pytree_node=False, default=0)  # 0 = static scale 1 (off)
    factor: float = flax.struct.field(pytree_node=False, default=2.0)

    @property
    def dynamic(self) -> bool:
        return self.growth_interval > 0

    def update(self, grads_finite: jax.Array) -> LossScale:
        if not self.dynamic:
            return self.replace(skipped=self.skipped + (~grads_finite).astype(jnp.int32))
        grow = grads_finite & (self.good_steps + 1 >= self.growth_interval)
        scale = jnp.where(grads_finite, jnp.where(grow, self.scale * self.factor, self.scale),
                          jnp.maximum(self.scale / self.factor, 1.0))
        good = jnp.where(grads_finite & ~grow, self.good_steps + 1, 0)
        return self.replace(scale=scale, good_steps=good.astype(jnp.int32),
                            skipped=self.skipped + (~grads_finite).astype(jnp.int32))


def initial_loss_scale(cfg: Config, compute_dtype: jnp.dtype) -> LossScale:
    dynamic = jnp.dtype(compute_dtype) == jnp.float16
    return LossScale(
        scale=jnp.asarray(cfg.optim.loss_scale_init if dynamic else 1.0, jnp.float32),
        good_steps=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
        growth_interval=cfg.optim.loss_scale_growth_interval if dynamic else 0,
        factor=cfg.optim.loss_scale_factor,
    )


def all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)
