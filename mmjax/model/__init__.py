"""Flax NNX model code: layers, Llama-style decoder, ViT, projector and the MLLM that merges them.

Model files carry only logical axis names; `mmjax.parallel` maps them onto the mesh.
"""

from mmjax.model.layers import logical_axes, resolve_dtype
from mmjax.model.mllm import MLLM

__all__ = ["MLLM", "logical_axes", "resolve_dtype"]
