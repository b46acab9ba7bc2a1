"""The paged forward and the model runner: chunked paged prefill equals the plain forward; buckets compile once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmjax.model.decoder import PagedMeta
from mmjax.serving.buckets import buckets
from mmjax.serving.images import ImageInput, image_hash
from mmjax.serving.kv_manager import KVCacheManager
from mmjax.serving.request import Request, SamplingParams
from mmjax.serving.runner import ModelRunner
from mmjax.serving.scheduler import Scheduler


def _paged_chunks(model, tokens, images, chunks, page_size=4, num_pages=16):
    """Run `tokens` through forward_paged chunk by chunk (pages in a shuffled order); logits of every token."""
    cfg = model.cfg
    t_img = cfg.image_tokens
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, pools, tok, pos, rows, mask, blocks, meta):
        return nnx.merge(graphdef, state).forward_paged(tok[None], pos[None], pools, meta, rows[None], mask[None],
                                                        blocks[None])

    encoded = [np.asarray(nnx.merge(graphdef, state).encode_images(jnp.asarray(im)[None])[0]) for im in images]
    n = len(tokens)
    is_img = np.asarray(tokens) == model.image_token_id
    rank = np.cumsum(is_img) - 1
    block = np.where(is_img, rank // t_img + 1, 0).astype(np.int32)
    rows = np.zeros((n, cfg.text.dim), np.float32)
    for i in np.flatnonzero(is_img):
        rows[i] = encoded[rank[i] // t_img][rank[i] % t_img]
    pages = np.random.default_rng(0).permutation(np.arange(1, num_pages))[: -(-n // page_size)].astype(np.int32)
    max_pages = 8
    pools = model.decoder.init_pools(num_pages, page_size)
    out = []
    for start, end in chunks:
        t = 16  # one bucket: padding tokens after the chunk
        m = end - start
        pos = np.arange(start, end)
        slot = np.arange(t) % page_size  # padding: the null page
        slot[:m] = pages[pos // page_size] * page_size + pos % page_size
        table = np.zeros((t, max_pages), np.int32)
        table[0, :len(pages)] = pages
        kv_blocks = np.zeros((t, max_pages * page_size), np.int32)
        kv_blocks[0, :n] = block
        z = np.zeros(t, np.int32)
        meta = PagedMeta(slot_mapping=slot.astype(np.int32), page_table=table, query_start=z,
                         query_len=np.r_[m, z[1:]].astype(np.int32), context_len=np.r_[end, z[1:]].astype(np.int32),
                         logits_indices=np.arange(t, dtype=np.int32), kv_block_ids=kv_blocks)
        pad = lambda a, fill=0: np.concatenate([a, np.full((t - m, *a.shape[1:]), fill, a.dtype)])
        logits, pools = step(state, pools, pad(np.asarray(tokens[start:end], np.int32)), pad(pos.astype(np.int32)),
                             pad(rows[start:end]), pad(is_img[start:end]), pad(block[start:end]), meta)
        out.append(np.asarray(logits)[:m])
    return np.concatenate(out)


def test_paged_forward_in_chunks_equals_plain_forward(tiny):
    for text_only in (False, True):
        cfg = tiny["config"](text_only=text_only)
        model = tiny["model"](cfg, seed=1)
        ref = tiny["reference"](model, size=32)
        rng = np.random.default_rng(2)
        tokens = rng.integers(4, cfg.vocab_size, 22).tolist()
        images = []
        if not text_only:  # two images of 4 tokens at 3..7 and 12..16
            tokens[3:7] = tokens[12:16] = [tiny["image_token"]] * 4
            images = [rng.standard_normal((8, 8, 3)).astype(np.float32) for _ in range(2)]
        want = ref.logits(tokens, images)
        got = _paged_chunks(model, tokens, images, [(0, 3), (3, 9), (9, 16), (16, 17), (17, 22)])
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_buckets():
    assert buckets(16, 64) == (16, 32, 64)
    assert buckets(16, 48) == (16, 32, 48)
    assert buckets(16, 8) == (8,)
    assert buckets(1, 6) == (1, 2, 4, 6)


def test_runner_greedy_stream_no_recompiles_and_image_cache(tiny):
    """Scheduler + runner over several requests (chunked prefill, shared image) equal each request alone."""
    cfg = tiny["config"]()
    model = tiny["model"](cfg, seed=3)
    serve = tiny["serve"](page_size=4, num_pages=40, max_num_batched_tokens=16, max_num_seqs=4, min_token_bucket=8)
    runner = ModelRunner(model, serve, max_model_len=32)
    assert runner.warmup() == 2 * (len(runner.token_buckets) + len(runner.decode_shapes)) + 1  # + the encoder
    compiles = runner.num_compiles
    sched = Scheduler(KVCacheManager(serve.num_pages, serve.page_size), max_num_batched_tokens=16, max_num_seqs=4,
                      max_model_len=32)
    rng = np.random.default_rng(4)
    image = rng.standard_normal((8, 8, 3)).astype(np.float32)
    ref = tiny["reference"](model, size=32)
    want = {}
    for i, n in enumerate([5, 13, 9, 20]):
        prompt = rng.integers(4, cfg.vocab_size, n).tolist()
        mm = None
        if i % 2:
            prompt[2:6] = [tiny["image_token"]] * 4
            mm = ImageInput((image,), ((2, 6),), (image_hash(image),))
        params = SamplingParams(max_tokens=6, stop_token_ids=[tiny["image_token"]])
        sched.add_request(Request(f"r{i}", prompt, params, mm_data=mm))
        want[f"r{i}"] = ref.greedy(prompt, 6, [image] if mm else [])
    got = {rid: [] for rid in want}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sampled = runner.execute(out)
        for rid, tok in sampled.items():
            got[rid].append(tok.token)
            assert tok.logprob <= 0
        sched.update_from_output(out, {rid: tok.token for rid, tok in sampled.items()})
    assert got == want
    assert runner.num_compiles == compiles
    assert runner.image_cache.misses == 1 and runner.image_cache.hits == 1


def _decode_step_case(tiny):
    """(step(state, pools) -> (logits, pools), state, pools, live slots): one decode step of the paged forward (one
    token per sequence, `max_query_len=1`, laid out by slot) of a tiny model with head_dim 16, the Pallas
    kernel's smallest, over pools holding earlier tokens' k, v."""
    import dataclasses

    cfg = tiny["config"](text_only=True)
    cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, dim=64))
    model = tiny["model"](cfg, seed=3)
    graphdef, state = nnx.split(model)
    page_size, num_pages, s = 4, 12, 3
    rng = np.random.default_rng(4)
    pools = model.decoder.init_pools(num_pages, page_size)
    pools = tuple(jnp.asarray(rng.standard_normal(p.shape), p.dtype) for p in pools)
    lengths = np.array([5, 0, 9], np.int32)  # slot 1 unused
    table = np.array([[3, 7, 0], [0, 0, 0], [1, 2, 5]], np.int32)
    pos = np.maximum(lengths - 1, 0)
    slot = np.where(lengths > 0, table[np.arange(s), pos // page_size] * page_size + pos % page_size, 0)
    meta = PagedMeta(slot_mapping=slot.astype(np.int32), page_table=table, query_start=np.arange(s, dtype=np.int32),
                     query_len=(lengths > 0).astype(np.int32), context_len=lengths,
                     logits_indices=np.arange(s, dtype=np.int32), max_query_len=1, slot_tokens=True)
    meta = jax.tree.map(jnp.asarray, meta)
    tokens = jnp.asarray(rng.integers(4, cfg.vocab_size, s).astype(np.int32))

    def step(state, pools):
        return nnx.merge(graphdef, state).forward_paged(tokens[None], jnp.asarray(pos)[None], pools, meta)

    return step, state, pools, lengths > 0


def _assert_same_step(got, want, live, tol):
    (got_logits, got_pools), (want_logits, want_pools) = got, want
    np.testing.assert_allclose(np.asarray(got_logits)[live], np.asarray(want_logits)[live], atol=tol, rtol=tol)
    for g, w in zip(got_pools, want_pools):
        g, w = np.asarray(g), np.asarray(w)
        np.testing.assert_array_equal(g[0, :, 1:], w[0, :, 1:])  # page 0: the null page padding writes to
        # the next layer's k, v follow the first layer's attention output, equal up to rounding
        np.testing.assert_allclose(g[1:, :, 1:], w[1:, :, 1:], atol=tol, rtol=tol)


def test_decode_step_with_kernel_written_kv_equals_the_scatter(tiny):
    """The decode step with the Pallas attention kernel writing the step's k, v itself (a GPU assumed; interpret
    mode) gives the logits and pools of the XLA path's scatter-then-attend."""
    from mmjax.kernels import _dispatch

    step, state, pools, live = _decode_step_case(tiny)
    want = jax.jit(step)(state, pools)
    with _dispatch.assume_platform("gpu", (9, 0)):  # a new function: jit's trace cache does not see the platform
        kernel_step = jax.jit(lambda state, pools: step(state, pools))
        assert "mmjax_ragged_paged_attention_write_kv" in str(kernel_step.trace(state, pools).jaxpr)
        got = kernel_step(state, pools)
    _assert_same_step(got, want, live, 2e-5)


@pytest.mark.gpu
def test_decode_step_with_kernel_written_kv_on_gpu(tiny, monkeypatch):
    """On the GPU: the same step with the kernel's k, v writes against the kernel after a scatter
    (`FUSE_KV_WRITE` off)."""
    import importlib

    rpa = importlib.import_module("mmjax.kernels.ragged_paged_attention")
    step, state, pools, live = _decode_step_case(tiny)
    got = jax.jit(step)(state, pools)
    monkeypatch.setattr(rpa, "FUSE_KV_WRITE", False)
    want = jax.jit(lambda state, pools: step(state, pools))(state, pools)
    _assert_same_step(got, want, live, 1e-3)
