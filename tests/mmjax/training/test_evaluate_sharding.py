"""Evaluation generates through the serving engine: under a data x tensor mesh its steps (and the image encoder)
are traced inside the run's sharding context and give the same tokens as without a mesh; new parameters are
swapped in without recompiling, and no cache computed with the old ones leaks into the next evaluation."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mmjax import kernels
from mmjax.config import load_config
from mmjax.data.pipeline import EvalSet
from mmjax.parallel import sharding as sharding_module
from mmjax.parallel.mesh import make_mesh
from mmjax.parallel.sharding import context_from_config
from mmjax.training.evaluate import Evaluator, eval_serve_config, make_eval_engine
from mmjax.training.init import model_setup

IMAGE, EOS = 3, 2
TINY = ["model.vocab_size=64", "model.max_seq_len=32", "model.text.dim=32", "model.text.mlp_dim=64",
        "model.text.n_layers=1", "model.text.n_heads=4", "model.text.n_kv_heads=2", "model.vision.image_size=8",
        "model.vision.patch_size=4", "model.vision.dim=16", "model.vision.n_layers=1", "model.vision.n_heads=2",
        "model.vision.mlp_dim=24", "model.compute_dtype=float32", "train.global_batch_size=4",
        "eval.batch_size=4", "eval.max_new_tokens=3", "serve.page_size=4", "mesh.data=2", "mesh.tensor=2"]


class Tokenizer:
    eos_id = EOS

    def decode(self, ids):
        ids = list(ids)
        return " ".join(str(i) for i in (ids[:ids.index(EOS)] if EOS in ids else ids))


def eval_set(n: int = 6, size: int = 16) -> EvalSet:
    """Prompts sharing a prefix and (every other one) the same image, so the prefix and image caches hit."""
    rng = np.random.default_rng(0)
    tokens = np.zeros((n, size), np.int32)
    lens = rng.integers(10, size + 1, n).astype(np.int32)
    shared = rng.integers(4, 64, 5)
    pictures = rng.standard_normal((2, 8, 8, 3)).astype(np.float32)
    images = np.zeros((n, 1, 8, 8, 3), np.float32)
    for i in range(n):
        tokens[i, :lens[i]] = rng.integers(4, 64, lens[i])
        tokens[i, :5] = shared
        tokens[i, 5:9] = IMAGE  # one image of 4 tokens
        images[i, 0] = pictures[i % 2]
    seg = (np.arange(size) < lens[:, None]).astype(np.int32)
    return EvalSet(ids=[str(i) for i in range(n)], tokens=tokens, segment_ids=seg, positions=np.where(
        seg > 0, np.arange(size), 0).astype(np.int32), prompt_lens=lens, images=images,
        image_valid=np.ones((n, 1), bool), answers=["1"] * n, qtypes=["q"] * n, majority_answer="1",
        baseline_majority=0.0)


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(None, TINY)
    mesh = make_mesh(cfg, jax.devices()[:4])
    s = model_setup(cfg, mesh, image_token_id=IMAGE)
    return cfg, mesh, s, s.make_params()


def test_eval_serve_config_sized_from_eval_settings(setup):
    cfg = setup[0]
    serve = eval_serve_config(cfg, 16)
    assert (serve.max_model_len, serve.max_num_seqs, serve.max_num_batched_tokens) == (19, 4, 64)
    assert serve.min_slot_bucket == serve.min_token_bucket == 4 and serve.max_logprobs == serve.max_beam_width == 0
    assert serve.num_pages == 1 + 4 * 5  # 19 tokens = five pages of 4 per request, plus the null page
    user = eval_serve_config(load_config(None, TINY + ["serve.num_pages=100", "serve.max_num_seqs=2"]), 16)
    assert (user.num_pages, user.max_num_seqs, user.max_model_len) == (100, 2, 19)
    capped = eval_serve_config(cfg, 31)  # 31 + 3 > model.max_seq_len
    assert capped.max_model_len == 32


def test_eval_traced_in_the_sharding_context_same_tokens_as_without_mesh(setup, monkeypatch):
    cfg, mesh, s, params = setup
    seen = []  # the sharding context at each trace of the paged attention and of a constrained activation
    real_attention, real_constrain = kernels.ragged_paged_attention, sharding_module.constrain

    def attention_spy(*args, **kw):
        seen.append(("attention", sharding_module.current()))
        return real_attention(*args, **kw)

    def constrain_spy(x, names):
        seen.append(("constrain", sharding_module.current()))
        return real_constrain(x, names)

    monkeypatch.setattr(kernels, "ragged_paged_attention", attention_spy)
    for module in ("mmjax.model.decoder", "mmjax.model.vision"):
        monkeypatch.setattr(f"{module}.constrain", constrain_spy, raising=False)
    data = eval_set()
    ctx = context_from_config(cfg, mesh)
    sharded = Evaluator(data, Tokenizer(), make_eval_engine(cfg, s.graphdef, params, Tokenizer(), data, mesh, ctx),
                        cfg.eval.batch_size, cfg.eval.max_new_tokens)
    got = sharded.generate(params)
    pools = sharded.engine.runner.pools
    assert pools[0].sharding.spec == P(None, "tensor")  # each device holds its kv heads' pages
    assert pools[0].addressable_shards[0].data.shape[1] == cfg.model.text.n_kv_heads // 2
    kinds = {kind for kind, _ in seen}
    assert kinds == {"attention", "constrain"}
    assert all(c is ctx for _, c in seen)  # every trace inside the run's one context

    seen.clear()
    local = jax.device_put(jax.device_get(params), jax.devices()[0])
    plain = Evaluator(data, Tokenizer(), make_eval_engine(cfg, s.graphdef, local, Tokenizer(), data),
                      cfg.eval.batch_size, cfg.eval.max_new_tokens)
    want = plain.generate(local)
    assert seen and all(c is None for _, c in seen)
    assert got == want and len(got) == len(data)
    assert all(1 <= len(t) <= cfg.eval.max_new_tokens for t in got)
    scores, predictions = sharded.run(params)
    assert predictions == [Tokenizer().decode(t) for t in got] and "eval/exact_match/q" in scores


def test_new_params_swap_in_without_recompiling_or_stale_caches(setup):
    cfg, mesh, s, params = setup
    data = eval_set()
    ctx = context_from_config(cfg, mesh)
    evaluator = Evaluator(data, Tokenizer(), make_eval_engine(cfg, s.graphdef, params, Tokenizer(), data, mesh, ctx),
                          cfg.eval.batch_size, cfg.eval.max_new_tokens)
    evaluator.generate(params)
    runner = evaluator.engine.runner
    compiles = runner.num_compiles
    assert runner.image_cache.hits > 0 and evaluator.engine.kv.hits > 0  # the caches are in play
    rng = np.random.default_rng(1)
    other = jax.tree.map(lambda x: (x + 0.3 * rng.standard_normal(x.shape).astype(x.dtype)).astype(x.dtype), params)
    got = evaluator.generate(other)
    assert runner.num_compiles == compiles
    fresh = Evaluator(data, Tokenizer(), make_eval_engine(cfg, s.graphdef, other, Tokenizer(), data, mesh, ctx),
                      cfg.eval.batch_size, cfg.eval.max_new_tokens)
    assert got == fresh.generate(other)
    with pytest.raises(ValueError, match="shapes"):
        runner.update_weights(jax.tree.map(lambda x: x[..., :1], params))
