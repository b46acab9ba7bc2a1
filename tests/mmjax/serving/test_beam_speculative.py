"""Beam search and speculative decoding inside the engine loop, on a tiny Llama converted from Hugging Face:
beam requests equal `transformers` `generate(num_beams=...)` token for token while greedy requests run in
the same steps; speculative greedy (n-gram and draft proposers) equals plain greedy; the rejection sampler
keeps the target distribution (chi-square); acceptance counters add up; every page returns."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as T
from scipy import stats

from mmjax.checkpoint.convert import import_hf
from mmjax.config import ServeConfig, SpeculativeConfig
from mmjax.serving.engine import LLM
from mmjax.serving.load import load_model
from mmjax.serving.request import RequestError, SamplingParams
from mmjax.serving.speculative.proposers import NgramProposer
from mmjax.serving.speculative.verify import rejection_sample

VOCAB = 64
SERVE = dict(page_size=4, num_pages=96, max_num_batched_tokens=32, max_num_seqs=8, min_token_bucket=32,
             min_slot_bucket=8, max_model_len=40, max_logprobs=0, max_beam_width=3)


class IdTokenizer:
    eos_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A random tiny Hugging Face Llama and its mmjax import."""
    root = tmp_path_factory.mktemp("beam")
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.eval().save_pretrained(root / "hf")
    import_hf(root / "hf", root / "mm")
    cfg, mm = load_model(root / "mm", overrides=["model.compute_dtype=float32"])
    return dict(torch=model, cfg=cfg, model=mm)


def engine(hf, method, draft=None):
    cfg = dataclasses.replace(hf["cfg"], serve=ServeConfig(**SERVE, speculative=SpeculativeConfig(
        method=method, num_tokens=3, adaptive=method == "ngram")))
    return LLM(cfg, hf["model"], IdTokenizer(), draft_model=draft)


@pytest.fixture(scope="module")
def ngram_llm(hf):
    """One engine for beam search, greedy and sampled requests, with n-gram speculation on, adaptive k (one
    compile)."""
    return engine(hf, "ngram")


def hf_generate(model, prompt, max_new, eos=None, **beam):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                             pad_token_id=0, **beam)
    seqs = []
    for row in out[:, len(prompt):].tolist():
        if eos is not None and eos in row:
            row = row[:row.index(eos) + 1]
        seqs.append(row)
    return seqs


PROMPTS = [[1, 17, 40, 9, 22, 51], [1, 8, 8, 30, 2, 45, 12, 60, 33], [1, 5, 6, 7, 5, 6, 7, 5, 6], [1, 44, 3]]


def test_beam_search_equals_transformers_with_greedy_requests_in_the_same_steps(hf, ngram_llm):
    # an EOS the model does produce, so beams finish early: the 3rd token of prompt 0's 3-beam search
    eos = hf_generate(hf["torch"], PROMPTS[0], 6, num_beams=3)[0][2]
    llm = ngram_llm
    llm.engine.tokenizer.eos_id = eos
    cases = [(PROMPTS[0], dict(num_beams=3, length_penalty=1.0, early_stopping=False), 10),
             (PROMPTS[1], dict(num_beams=2, length_penalty=0.5, early_stopping=True), 12),
             (PROMPTS[2], dict(num_beams=3, length_penalty=2.0, early_stopping="never", num_return_sequences=2), 9),
             (PROMPTS[3], dict(num_beams=3, length_penalty=-1.0, early_stopping=False), 14)]
    prompts, params, want = [], [], []
    for prompt, beam, max_new in cases:
        prompts.append(prompt)
        params.append(SamplingParams(max_tokens=max_new, use_beam_search=True, best_of=beam["num_beams"],
                                     n=beam.get("num_return_sequences", 1), length_penalty=beam["length_penalty"],
                                     early_stopping=beam["early_stopping"]))
        want.append(hf_generate(hf["torch"], prompt, max_new, eos=eos, **beam))
        # a greedy request beside each beam search, in the same steps
        prompts.append(prompt[:4] + [11, 12])
        params.append(SamplingParams(max_tokens=7))
        want.append(hf_generate(hf["torch"], prompt[:4] + [11, 12], 7, eos=eos))
    outs = llm.generate(prompts, params)
    for out, sp, w in zip(outs, params, want):
        if sp.use_beam_search:
            assert [b[0] for b in out.beams] == w, out.request_id
            assert out.token_ids == w[0]
            assert out.finish_reason == ("stop" if w[0][-1] == eos else "length")
            # each token's logprob as the search chose it: their sum, length-penalised, is the best beam's score
            lps = [t.logprob for t in out.logprobs]
            assert len(lps) == len(out.token_ids) and all(np.isfinite(lps)) and max(lps) <= 0
            assert sum(lps) / len(lps) ** sp.length_penalty == pytest.approx(out.beams[0][1], rel=1e-4)
        else:
            assert out.token_ids == w[0] and not out.beams
    assert any(o.token_ids[-1] == eos for o, sp in zip(outs, params) if sp.use_beam_search)
    kv = llm.engine.kv
    kv.check_consistency()
    assert kv.num_free_pages == kv.num_usable_pages and not any(kv.ref_counts)
    with pytest.raises(RequestError, match="max_beam_width"):
        llm.engine.add_request([1, 2, 3], sampling_params=SamplingParams(use_beam_search=True, best_of=4))
    with pytest.raises(RequestError, match="temperature 0"):
        SamplingParams(use_beam_search=True, n=2, temperature=0.7)
    llm.engine.tokenizer.eos_id = None


def test_beam_fork_copies_only_the_shared_partial_page():
    from mmjax.serving.kv_manager import KVCacheManager
    from mmjax.serving.request import Request
    kv = KVCacheManager(16, 4)
    r = Request("a", list(range(4, 14)), SamplingParams())  # 10 tokens: pages 0, 1 full, page 2 half
    kv.allocate_slots(r, 10)
    kv.fork("a", "b")
    kv.fork("a", "c")
    kv.free("a")
    assert kv.copy_on_write("b", 10) not in (True, None)  # page 2 still shared with c: b gets a copy
    assert kv.copy_on_write("c", 10) is True  # c now holds page 2 alone
    assert kv.copy_on_write("b", 8) is True
    shared = kv.block_table("b")[:2]
    assert shared == kv.block_table("c")[:2] and all(kv.ref_counts[p] == 2 for p in shared)
    kv.check_consistency()
    kv.free("b")
    kv.free("c")
    kv.check_consistency()
    assert kv.num_free_pages == kv.num_usable_pages


def _greedy_stream(llm, prompts, max_tokens):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens))]


REPETITIVE = [[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 20, 21, 22, 20, 21, 22, 20], [1, 17, 40, 9, 22, 51],
              [1, 30, 31, 30, 31, 30, 31, 30, 31, 30, 31, 30, 31, 30, 31, 30, 31, 30, 31, 30, 31]]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_greedy_equals_plain_greedy(hf, ngram_llm, method):
    """Plain greedy here is transformers' (the engine without speculation equals it: test_load)."""
    want = [hf_generate(hf["torch"], p, 12)[0] for p in REPETITIVE]
    llm = ngram_llm
    if method == "draft":  # the target's weights with noise: a draft that agrees often, not always
        rng = np.random.default_rng(0)
        from flax import nnx
        graphdef, state = nnx.split(hf["model"])
        llm = engine(hf, "draft", (graphdef, jax.tree.map(
            lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype), state)))
    stats0 = llm.engine.stats()
    prompts = [*REPETITIVE, [1, 9, 9]]
    params = [SamplingParams(max_tokens=12)] * len(REPETITIVE) + [
        SamplingParams(max_tokens=6, temperature=0.9, seed=3)]  # a sampled request in the same steps
    eng = llm.engine
    checked = []
    if method == "draft":  # each draft's probabilities sit in its bank row, on the device
        propose = eng.proposer.propose

        def checked_propose(requests):
            probs = propose(requests)
            bank = np.asarray(probs.bank)
            for r in requests:
                for j, tok in enumerate(r.spec_token_ids):
                    q = bank[probs.first_row[r.request_id] + j]
                    np.testing.assert_allclose(q.sum(), 1.0, atol=1e-5)
                    assert q[tok] == 1.0 if r.sampling_params.greedy else q[tok] > 0
                    checked.append(r.sampling_params.greedy)
            return probs
        eng.proposer.propose = checked_propose
        launch = eng.runner._launch

        def checked_launch(step, batch, sampling):  # the target step gathers each slot's draft rows from the bank
            if "draft_bank" in batch:
                bank = np.asarray(batch["draft_bank"])
                for i, d in enumerate(batch["num_draft"]):
                    for j in range(d):
                        assert bank[batch["draft_rows"][i, j], batch["drafts"][i, j]] > 0
                        checked.append("verify")
            return launch(step, batch, sampling)
        eng.runner._launch = checked_launch
    ids = [eng.add_request(p, sampling_params=sp) for p, sp in zip(prompts, params)]
    events = dict.fromkeys(ids, 0)  # steps in which a request got tokens
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            events[o.request_id] += bool(o.new_token_ids)
            assert len(o.logprobs) == len(o.new_token_ids)
            if o.finished:
                final[o.request_id] = o
    outs = [final[rid] for rid in ids]
    assert [o.token_ids for o in outs[:-1]] == want
    assert len(outs[-1].token_ids) == 6
    # every step that verified drafts emitted the accepted ones plus one token
    assert all(len(o.token_ids) == events[o.request_id] + o.metrics.num_accepted_tokens for o in outs)
    st = {k: v - stats0[k] for k, v in llm.engine.stats().items() if k.startswith("spec_") and "rate" not in k}
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert st["spec_draft_tokens"] == drafted > 0 and st["spec_accepted_tokens"] == accepted > 0
    assert 0 <= accepted < drafted
    assert all(0 <= o.metrics.num_accepted_tokens <= o.metrics.num_draft_tokens for o in outs)
    kv = llm.engine.kv
    kv.check_consistency()
    assert kv.num_free_pages == kv.num_usable_pages
    if method == "draft":
        assert {True, False, "verify"} <= set(checked)  # greedy and sampled drafts, and the target's gather


def test_ngram_lookup():
    p = NgramProposer(SpeculativeConfig(method="ngram", num_tokens=3, ngram_max=3))
    assert p.lookup([1, 5, 6, 7, 8, 9, 5, 6, 7]) == [8, 9, 5]
    assert p.lookup([1, 2, 3, 4]) == []
    assert p.lookup([4, 1, 2, 9, 2]) == [9, 2]  # the latest earlier match of the 1-gram, cut at the end


def test_rejection_sampling_keeps_the_target_distribution():
    """Many seeded rows at once: the first emitted token follows p_0, and after an accepted first draft the
    second follows p_1, for a draft distribution q far from p (chi-square, tiny vocabulary)."""
    rng = np.random.default_rng(0)
    v, k, n = 5, 2, 20000
    p = rng.dirichlet(np.ones(v), size=k + 1).astype(np.float32)
    q = rng.dirichlet(np.ones(v) * 0.5, size=k).astype(np.float32)
    drafts = np.stack([rng.choice(v, n, p=q[i] / q[i].sum()) for i in range(k)], axis=1).astype(np.int32)
    keys = jax.random.split(jax.random.key(1), n)
    fn = jax.jit(rejection_sample)
    tokens, num = fn(jnp.broadcast_to(p, (n, k + 1, v)), jnp.broadcast_to(q, (n, k, v)), drafts,
                     jnp.full(n, k, jnp.int32), keys)
    tokens, num = np.asarray(tokens), np.asarray(num)
    p = p.astype(np.float64) / p.astype(np.float64).sum(-1, keepdims=True)  # expected counts sum exactly to n
    assert ((num >= 1) & (num <= k + 1)).all()
    accepted = num - 1
    assert (tokens[np.arange(n), 0][accepted >= 1] == drafts[accepted >= 1, 0]).all()
    first = np.bincount(tokens[:, 0], minlength=v)
    assert stats.chisquare(first, p[0] * n).pvalue > 1e-3
    second = tokens[accepted >= 1, 1]  # the first draft was accepted: the next token is from p_1
    assert stats.chisquare(np.bincount(second, minlength=v), p[1] * len(second)).pvalue > 1e-3
    # one-hot drafts (q = None, an n-gram guess) and fewer valid drafts per row
    tokens, num = fn(jnp.broadcast_to(p, (n, k + 1, v)), None, drafts, jnp.full(n, 1, jnp.int32), keys)
    tokens, num = np.asarray(tokens), np.asarray(num)
    assert (num <= 2).all()
    assert stats.chisquare(np.bincount(tokens[:, 0], minlength=v), p[0] * n).pvalue > 1e-3
    np.testing.assert_allclose((num == 2).mean(), p[0][drafts[:, 0]].mean(), atol=0.01)
    assert stats.chisquare(np.bincount(tokens[num == 2, 1], minlength=v), p[1] * (num == 2).sum()).pvalue > 1e-3


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_dynamic_speculation_greedy_equals_plain_and_compiles_nothing(hf, ngram_llm, decode_steps):
    """serve.speculative.dynamic: the policy turns n-gram speculation on and off between steps (off: plain
    multi-step calls, or overlapped single steps with decode_steps=1); greedy tokens equal plain greedy
    (transformers') and speculation always on, nothing compiles after warm-up (the first pass warms the
    overlapped engine up: one warm-up is enough to test), every page returns."""
    prompts = [*REPETITIVE, [1, 9, 9, 9, 9, 9], [1, 2, 3, 4, 2, 3, 4]]
    want = [hf_generate(hf["torch"], p, 18)[0] for p in prompts]
    assert _greedy_stream(ngram_llm, prompts, 18) == want
    sc = SpeculativeConfig(method="ngram", num_tokens=3, dynamic=True, dynamic_probe_every=2)
    cfg = dataclasses.replace(hf["cfg"], serve=ServeConfig(**SERVE, decode_steps=decode_steps, speculative=sc))
    llm = LLM(cfg, hf["model"], IdTokenizer(), warmup=decode_steps > 1)
    eng = llm.engine
    compiles = eng.runner.num_compiles
    assert _greedy_stream(llm, prompts, 18) == want
    if decode_steps == 1:
        compiles = eng.runner.num_compiles
    assert _greedy_stream(llm, prompts[::-1], 18) == want[::-1]  # with measured times and acceptance
    st = eng.stats()
    assert st["spec_steps"] > 0 and st["spec_plain_calls"] > 0 and st["spec_accepted_tokens"] > 0
    assert eng.runner.num_chained > 0  # chained multi-step calls, or overlapped steps
    assert eng.runner.num_compiles == compiles
    eng.kv.check_consistency()
    assert eng.kv.num_free_pages == eng.kv.num_usable_pages
