"""Default sizing of the KV page pool and the running-sequence cap from the model and the device's memory.

`serve.num_pages = 0` (the default) gives the KV cache what is left of `serve.memory_utilization` of the
device's memory once the serving weights are placed, minus a reserve for one step's activations; with
`serve.max_num_seqs = 0` (the default) as many sequences run at once as the pool holds at half the model's
length, at most `MAX_AUTO_SEQS` and at most `max_num_batched_tokens`. A value set by the user is kept.
Pure arithmetic (`plan_kv_memory`) plus one reading of the device's memory statistics (`device_memory`), so
the rule is tested on the CPU with any budget.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mmjax.config import ModelConfig, ServeConfig
from mmjax.errors import ConfigError

log = logging.getLogger(__name__)

MAX_AUTO_SEQS = 256  # the most sequences the default sizing runs at once
# A pool (keys or values) holds at most this many elements, so 32-bit element offsets into the flattened
# pool [layers * kv_heads * pages, page_size, head_dim] cannot overflow.
MAX_POOL_ELEMENTS = 2**31 - 1
# Devices that report no memory statistics (the CPU): a pool of this many pages.
FALLBACK_NUM_PAGES = 512


@dataclasses.dataclass(frozen=True)
class KVMemoryPlan:
    """What the sizing chose and from what (bytes per device)."""

    num_pages: int
    max_num_seqs: int
    page_bytes: int  # one page of every layer's keys and values (and a draft model's, with speculation)
    budget_bytes: int | None  # memory_utilization x the device's memory - what is in use; None: no statistics
    reserve_bytes: int  # kept for a step's activations (and a draft model's probability bank)

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_bytes


def step_reserve_bytes(model: ModelConfig, serve: ServeConfig, max_model_len: int, max_slots: int) -> int:
    """An upper estimate of one step's working memory beside the weights and the pools, doubled for what XLA
    keeps besides: the largest token bucket's activations in float32 (residual, attention and MLP), the
    sampler's vocabulary-wide rows per slot (logits, log-softmax, penalty counts, the top-k/top-p sort), its
    token histories, the image encoder's activations of one image, a draft model's probability bank, and the
    token histories and search of the n-gram proposer on the device."""
    t = model.text
    tokens = serve.max_num_batched_tokens
    qkv = (t.n_heads + 2 * t.n_kv_heads) * t.resolved_head_dim
    act = tokens * (4 * t.dim + qkv + 3 * t.mlp_dim) * 4
    sampler = max_slots * model.vocab_size * 4 * 8 + 2 * max_slots * max_model_len * 4
    vision = 0
    if not model.text_only:
        v = model.vision
        patches = (v.image_size // v.patch_size) ** 2 + 1
        vision = patches * (4 * v.dim + 3 * v.mlp_dim) * 4 + patches * patches * v.n_heads * 4
    bank = 0
    if serve.speculative.method == "draft":  # the proposer's bank, or the drafts' rows inside the fused step
        bank = max_slots * serve.speculative.num_tokens * model.vocab_size * 4
    if serve.speculative.method == "ngram" and serve.speculative.proposer_on_device:
        # the token histories on the device, and the search's gathered rows and match masks in the step
        sampler += 5 * max_slots * max_model_len * 4
    return 2 * (act + sampler + vision) + bank


def plan_kv_memory(serve: ServeConfig, model: ModelConfig, *, max_model_len: int, page_bytes: int,
                   page_elements: int, budget_bytes: int | None) -> KVMemoryPlan:
    """`num_pages` and `max_num_seqs` for `serve` (each kept when set, i.e. not 0).

    `page_bytes`: one page of the pools per device (keys and values, every layer); `page_elements`: the elements
    of one page in one pool (the largest leaf); `budget_bytes`: device memory the engine may still take
    (`memory_utilization` x the device's memory - what is in use), None when the device reports none. Raises
    ConfigError when the budget cannot hold one request of `max_model_len` tokens."""
    cap = min(MAX_AUTO_SEQS, serve.max_num_batched_tokens)
    slots = serve.max_num_seqs or cap
    speculating = serve.speculative.method == "draft"
    # a draft model keeps a pool of as many pages; it is no larger than the target, so count the target's twice
    pool_page_bytes = page_bytes * (2 if speculating else 1)
    reserve = step_reserve_bytes(model, serve, max_model_len, slots)
    need = 1 + -(-(max_model_len - 1) // serve.page_size)  # the null page + one request of max_model_len tokens
    num_pages = serve.num_pages
    if not num_pages:
        if budget_bytes is None:
            num_pages = max(FALLBACK_NUM_PAGES, need)
        else:
            num_pages = (budget_bytes - reserve) // pool_page_bytes
            num_pages = min(num_pages, MAX_POOL_ELEMENTS // page_elements)
            if num_pages < need:
                raise ConfigError(
                    f"serve.num_pages=0 (sized from memory): {max(budget_bytes, 0) / 2**30:.2f} GiB left for the "
                    f"engine ({reserve / 2**30:.2f} GiB reserved for a step's activations) hold {max(num_pages, 0)}"
                    f" KV pages of {pool_page_bytes} bytes, but one request of serve.max_model_len={max_model_len} "
                    f"tokens needs {need}; raise serve.memory_utilization, lower serve.max_model_len or "
                    "serve.max_num_batched_tokens, or set serve.num_pages")
    max_num_seqs = serve.max_num_seqs
    if not max_num_seqs:
        tokens = (num_pages - 1) * serve.page_size
        max_num_seqs = max(1, min(cap, tokens // max(1, max_model_len // 2)))
    return KVMemoryPlan(int(num_pages), int(max_num_seqs), pool_page_bytes, budget_bytes, reserve)


def device_memory(devices: Sequence[Any], utilization: float) -> int | None:
    """The bytes the engine may still take on its most loaded device: `utilization` x the memory the device's
    allocator may use (`bytes_limit`) - what it holds now (`bytes_in_use`: the weights, ...). None when a
    device reports no statistics (the CPU)."""
    budgets = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        budgets.append(int(utilization * stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return min(budgets) if budgets else None


def pool_page_size(pools_of_one_page: Any, sharding: Any = None) -> tuple[int, int]:
    """(bytes per device of one page of the pools, elements of one page in the largest pool leaf) from the
    abstract pools of a single page (`jax.eval_shape` of `init_pools(1, ...)`), split as `sharding` splits them."""
    total, most = 0, 0
    for leaf in jax.tree.leaves(pools_of_one_page):
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
        most = max(most, math.prod(leaf.shape))
    return total, most


def size_serving(serve: ServeConfig, model: ModelConfig, *, max_model_len: int, pools_of_one_page: Any,
                 devices: Sequence[Any], sharding: Any = None) -> ServeConfig:
    """`serve` with `num_pages` and `max_num_seqs` filled in where they are 0 (see the module docstring)."""
    if serve.num_pages and serve.max_num_seqs:
        return serve
    page_bytes, page_elements = pool_page_size(pools_of_one_page, sharding)
    budget = device_memory(devices, serve.memory_utilization) if not serve.num_pages else None
    plan = plan_kv_memory(serve, model, max_model_len=max_model_len, page_bytes=page_bytes,
                          page_elements=page_elements, budget_bytes=budget)
    log.info("serving sizes: num_pages=%d (%.2f GiB of KV, %s), max_num_seqs=%d", plan.num_pages,
             plan.kv_bytes / 2**30, "as set" if serve.num_pages else
             ("no device memory statistics: the fallback pool" if budget is None else
              f"of {budget / 2**30:.2f} GiB left at serve.memory_utilization={serve.memory_utilization}"),
             plan.max_num_seqs)
    return dataclasses.replace(serve, num_pages=plan.num_pages, max_num_seqs=plan.max_num_seqs)
