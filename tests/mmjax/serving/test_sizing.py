"""Default sizing of the KV pool and max_num_seqs (`serving/sizing.py`): for a given memory budget the pool
fills what is left after the step's reserve and holds one request of max_model_len, max_num_seqs follows the
pool, values set by the user are kept, a budget too small is a ConfigError naming the keys; an engine left at
the defaults on the CPU (no memory statistics) gets a valid pool and runs."""

import dataclasses

import jax
import pytest

from mmjax.config import Config, ServeConfig, load_config
from mmjax.errors import ConfigError
from mmjax.serving.engine import LLM
from mmjax.serving.request import SamplingParams
from mmjax.serving.sizing import MAX_AUTO_SEQS, plan_kv_memory, pool_page_size, step_reserve_bytes

GIB = 2**30


def llama_1b():
    cfg = load_config("models/llama_1b.yaml", ["model.text_only=true", "model.compute_dtype=bfloat16"])
    return cfg.model


def page_of(model, serve):
    """(bytes, elements) of one page, from the model's own pools."""
    from flax import nnx

    from mmjax.model import MLLM

    abstract = nnx.eval_shape(lambda: MLLM(model, image_token_id=0, rngs=nnx.Rngs(0)))
    import jax.numpy as jnp
    return pool_page_size(jax.eval_shape(lambda: abstract.decoder.init_pools(1, serve.page_size, jnp.bfloat16)))


@pytest.mark.parametrize("budget_gib", [4, 20, 60])
def test_plan_fills_the_budget_with_a_valid_pool(budget_gib):
    model, serve = llama_1b(), ServeConfig(max_num_batched_tokens=2048)
    page_bytes, elements = page_of(model, serve)
    t = model.text
    assert page_bytes == 2 * t.n_layers * t.n_kv_heads * serve.page_size * t.resolved_head_dim * 2  # k, v; bf16
    budget = budget_gib * GIB
    plan = plan_kv_memory(serve, model, max_model_len=2048, page_bytes=page_bytes, page_elements=elements,
                          budget_bytes=budget)
    reserve = step_reserve_bytes(model, serve, 2048, MAX_AUTO_SEQS)
    assert plan.reserve_bytes == reserve and plan.budget_bytes == budget
    assert plan.kv_bytes + reserve <= budget  # fits ...
    # ... and takes what is there, up to the 32-bit element cap of one pool
    assert budget - plan.kv_bytes - reserve < page_bytes or plan.num_pages * elements > 2**31 - 1 - elements
    assert plan.num_pages - 1 >= 2048 // serve.page_size  # one request of max_model_len fits
    assert 1 <= plan.max_num_seqs <= min(MAX_AUTO_SEQS, serve.max_num_batched_tokens)
    # as many sequences as the pool holds at half the model's length
    assert plan.max_num_seqs == min(MAX_AUTO_SEQS, (plan.num_pages - 1) * serve.page_size // 1024)
    # the planned values pass the config's validation and the engine's request-size check
    dataclasses.replace(serve, num_pages=plan.num_pages, max_num_seqs=plan.max_num_seqs).check(2048)


def test_plan_keeps_user_values_and_refuses_a_budget_too_small():
    model = llama_1b()
    serve = ServeConfig(max_num_batched_tokens=512)
    page_bytes, elements = page_of(model, serve)
    set_both = dataclasses.replace(serve, num_pages=300, max_num_seqs=3)
    plan = plan_kv_memory(set_both, model, max_model_len=2048, page_bytes=page_bytes, page_elements=elements,
                          budget_bytes=None)
    assert (plan.num_pages, plan.max_num_seqs) == (300, 3)
    # pages set, sequences from them: 299 pages of 16 tokens at 1024 tokens each
    plan = plan_kv_memory(dataclasses.replace(serve, num_pages=300), model, max_model_len=2048,
                          page_bytes=page_bytes, page_elements=elements, budget_bytes=None)
    assert plan.max_num_seqs == 299 * 16 // 1024
    # sequences set: the reserve counts them, the pool takes the rest
    small = plan_kv_memory(dataclasses.replace(serve, max_num_seqs=8), model, max_model_len=2048,
                           page_bytes=page_bytes, page_elements=elements, budget_bytes=8 * GIB)
    large = plan_kv_memory(serve, model, max_model_len=2048, page_bytes=page_bytes, page_elements=elements,
                           budget_bytes=8 * GIB)
    assert small.max_num_seqs == 8 and small.num_pages > large.num_pages
    with pytest.raises(ConfigError, match="serve.memory_utilization"):
        plan_kv_memory(serve, model, max_model_len=2048, page_bytes=page_bytes, page_elements=elements,
                       budget_bytes=large.reserve_bytes + 10 * page_bytes)


def test_engine_at_the_defaults_sizes_itself_on_the_cpu(tiny):
    model_cfg = tiny["config"](text_only=True)
    model = tiny["model"](model_cfg, seed=1)
    cfg = dataclasses.replace(Config(), model=model_cfg)
    assert cfg.serve.num_pages == 0 and cfg.serve.max_num_seqs == 0
    llm = LLM(cfg, model, tiny_tokenizer())
    serve = llm.engine.serve
    assert serve.num_pages >= 2 and 1 <= serve.max_num_seqs <= serve.max_num_batched_tokens
    assert llm.engine.kv.num_pages == serve.num_pages and llm.engine.runner.max_slots == serve.max_num_seqs
    assert jax.tree.leaves(llm.engine.runner.pools)[0].shape[2] == serve.num_pages
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [3, 3]


def tiny_tokenizer():
    from test_engine import CharTokenizer
    return CharTokenizer()
