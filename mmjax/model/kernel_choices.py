"""Whether each `model.*_impl` names a kernel implementation that can run on this machine.

`mmjax.config` validates shapes and ranges only (it imports nothing that starts JAX); this check asks the kernel
registry, without starting a backend, and runs where a model is about to be built: the training run's config check
(`mmjax.training.checks`) and the serving loader."""

from __future__ import annotations

from mmjax import kernels
from mmjax.config import ModelConfig
from mmjax.errors import ConfigError

# model.<key> -> the kernels.OPS entry it names an implementation of (its registry is the list of choices)
KERNEL_KEYS = {"attention_impl": "attention", "norm_impl": "norm", "loss_impl": "cross_entropy",
               "activation_impl": "bias_gelu", "swiglu_impl": "swiglu"}


def check_kernel_choices(m: ModelConfig) -> None:
    """Each model.*_impl names a registered implementation that can run here (`auto` always can)."""
    for key, op_name in KERNEL_KEYS.items():
        op, value = kernels.OPS[op_name], getattr(m, key)
        choices = ("auto", *op.available())
        if value not in choices:
            raise ConfigError(f"model.{key}={value!r} is not one of {choices}")
        reason = op.unsupported_here(value, m.compute_dtype)
        if reason is not None:
            raise ConfigError(f"model.{key}={value} cannot run on this machine: {reason}; use auto")
