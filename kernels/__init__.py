"""Kernels: one folder per op, each with a pure-jnp reference and capability-guarded implementations."""

from kernels.attention import attention

__all__ = ["attention"]
