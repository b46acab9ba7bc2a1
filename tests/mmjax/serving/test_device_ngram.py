"""The on-device prompt lookup equals the host proposer (`NgramProposer.lookup`) on random histories: repeats
at several n (multiple matches: the latest wins, the longest n first), no match, histories shorter than n, a
match whose continuation is cut by the history's end; history rows, uploads and appends on the device keep
equal to the host's lists. The engine with `serve.speculative.proposer_on_device`: greedy tokens equal plain
greedy and the host proposer's, every step's proposals (and so the acceptance counts) equal the host's, also
with dynamic speculation and through preemption; nothing compiles after warm-up; bad settings are refused."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.config import SpeculativeConfig
from mmjax.serving.speculative.device_ngram import (
    DeviceHistory,
    append_tokens,
    ngram_search,
    place_drafts,
    propose_drafts,
    set_rows,
)
from mmjax.serving.speculative.proposers import NgramProposer


@pytest.mark.parametrize("n_min, n_max, k", [(1, 4, 3), (2, 3, 5)])
def test_device_search_equals_host_lookup(n_min, n_max, k):
    cfg = SpeculativeConfig(method="ngram", num_tokens=k, ngram_min=n_min, ngram_max=n_max)
    host = NgramProposer(cfg)
    rng = np.random.default_rng(n_min)
    slots, max_len = 64, 40
    hist = np.zeros((slots, max_len), np.int32)
    lengths = rng.integers(1, max_len + 1, slots)
    lengths[:4] = [1, 2, 3, max_len]
    for s in range(slots):
        vocab = [3, 6, 1000][s % 3]  # small vocabularies: many (multiple) matches; large: mostly none
        hist[s, :lengths[s]] = rng.integers(0, vocab, lengths[s])
    hist[4, :12] = np.arange(12)  # no repeat at all
    lengths[4] = 12
    hist[5, :8], lengths[5] = [7, 8, 9, 1, 7, 8, 9, 7], 8  # the match's continuation runs into the end
    hist[6, :9], lengths[6] = [5, 1, 2, 5, 1, 2, 9, 1, 2], 9  # 2-gram at two places: the latest
    drafts, num = ngram_search(jnp.asarray(hist), jnp.asarray(lengths, jnp.int32), k=k, n_min=n_min, n_max=n_max)
    drafts, num = np.asarray(drafts), np.asarray(num)
    found = 0
    for s in range(slots):
        want = host.lookup(hist[s, :lengths[s]].tolist(), k)
        assert drafts[s, :num[s]].tolist() == want, s
        found += bool(want)
    assert 0 < found < slots and num[4] == 0


def test_device_history_rows_appends_and_drafts_match_the_host():
    """Rows uploaded by `DeviceHistory` (more requests than rows: one is reused), appends on the device and
    the drafts cut to each slot's reserved count equal the host's lookup over its lists; drafts land in their
    slots' reserved positions of a flat token batch."""
    k = 3
    host = NgramProposer(SpeculativeConfig(method="ngram", num_tokens=k, ngram_max=3))
    upload, append = jax.jit(set_rows), jax.jit(append_tokens)
    propose = jax.jit(functools.partial(propose_drafts, k=k, n_min=1, n_max=3))
    hist = DeviceHistory(rows=4, max_len=32)
    rng = np.random.default_rng(1)
    lists = {f"r{i}": rng.integers(0, 4, int(n)).tolist() for i, n in enumerate((3, 7, 1, 10, 5))}
    hist.row("r4", 5, lambda: lists["r4"], set())  # r4 takes a row, loses it to the step below: not in it
    step = ["r0", "r1", "r2", "r3"]
    for it in range(5):
        rows = np.asarray([hist.row(r, len(lists[r]), lambda r=r: lists[r], set(step)) for r in step], np.int32)
        hist.flush(upload)
        assert "r4" not in hist._rows and len(set(rows.tolist())) == 4
        lengths = np.asarray([len(lists[r]) for r in step], np.int32)
        reserved = np.asarray([3, 2, 0, 1], np.int32)
        drafts, num = (np.asarray(x) for x in propose(hist.tokens, rows, lengths, reserved))
        for s, r in enumerate(step):
            assert drafts[s, :num[s]].tolist() == host.lookup(lists[r], k)[:reserved[s]]
        # slot s's tokens at [4 s, 4 s + 4): its last known token, then its reserved draft positions
        flat = np.asarray(place_drafts(jnp.full(16, -1, jnp.int32), jnp.arange(4, dtype=jnp.int32) * 4 + 1,
                                       jnp.asarray(reserved), jnp.asarray(drafts), jnp.asarray(num)))
        for s in range(4):
            want = [*drafts[s, :num[s]], *[0] * (reserved[s] - num[s]), *[-1] * (3 - reserved[s])]
            assert flat[4 * s + 1:4 * s + 4].tolist() == want
        new = rng.integers(0, 4, (4, 3)).astype(np.int32)
        count = rng.integers(0, 4, 4).astype(np.int32)
        hist.tokens = append(hist.tokens, jnp.asarray(rows), jnp.asarray(lengths), jnp.asarray(new),
                             jnp.asarray(count))
        for s, r in enumerate(step):
            lists[r] += new[s, :count[s]].tolist()
            hist.wrote(r, len(lists[r]))
        if it == 2:  # a request whose tokens grew off the device: its row goes up again
            lists["r2"] += [1, 2]
    assert hist.num_uploads == 4 + 1 + 1  # each row once, r4 once, r2 again
    tokens = np.asarray(hist.tokens)
    for s, r in enumerate(step):
        assert tokens[rows[s], :len(lists[r])].tolist() == lists[r]


# -- the engine with the proposer on the device (serve.speculative.proposer_on_device) --------------------------

REPETITIVE = [[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 20, 21, 22, 20, 21, 22, 20], [1, 9, 9, 9, 9, 9],
              [1, 30, 31, 30, 31, 30, 31, 30, 31, 30, 31], [1, 2, 3, 4, 2, 3, 4], [1, 44, 13, 50]]
MAX_TOKENS = 14


class _Ids:
    eos_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _engine(model, warmup=True, decode_steps=1, **spec):
    from mmjax.config import Config, ServeConfig
    from mmjax.serving.engine import Engine
    serve = ServeConfig(page_size=4, num_pages=80, max_num_batched_tokens=32, max_num_seqs=8, min_token_bucket=32,
                        min_slot_bucket=8, max_model_len=40, max_logprobs=0, decode_steps=decode_steps,
                        speculative=SpeculativeConfig(method="ngram", num_tokens=3, adaptive=True, **spec))
    return Engine(Config(model=model.cfg, serve=serve), model, _Ids(), warmup=warmup)


def _run(engine, prompts, params):
    """Every request's final output, in prompt order."""
    ids = [engine.add_request(p, sampling_params=sp) for p, sp in zip(prompts, params)]
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    return [final[rid] for rid in ids]


def _check_proposals(engine, seen):
    """Check each step the device proposed for against the host's lookup over the request's tokens at that
    step: as many drafts as it finds (within the reserved slots), and the accepted ones are its tokens."""
    host, collect = NgramProposer(engine.serve.speculative), engine.runner.collect

    def checked(pending):
        sampled = collect(pending)
        for e in pending.out.scheduled:
            got = sampled.get(e.request_id)
            if e.num_draft and got is not None:
                want = host.lookup(engine.scheduler.requests[e.request_id].all_token_ids)[:e.num_draft]
                assert got.num_draft == len(want) and list(got.tokens[:-1]) == want[:len(got.tokens) - 1]
                seen.append(len(want))
        return sampled
    engine.runner.collect = checked


@pytest.fixture(scope="module")
def lm(tiny):
    """A tiny text-only model and its greedy outputs for REPETITIVE (the plain forward, token by token)."""
    model = tiny["model"](tiny["config"](text_only=True), seed=3)
    ref = tiny["reference"](model, size=40)
    return dict(model=model, want=[ref.greedy(p, MAX_TOKENS, stop=()) for p in REPETITIVE])


def test_device_proposer_equals_host_proposer_and_plain_greedy(lm):
    """Greedy tokens with the proposer on the device equal plain greedy decoding and the host n-gram proposer's
    token for token (adaptive k: the draft slots vary per request); every step's proposals equal the host's
    lookup, so each request's drafted and accepted counts equal the host proposer's too, and a sampled request
    beside them draws the same tokens (a step that found no drafts emits the plain sampler's token, as a host
    step without proposals); nothing compiles after warm-up; every page returns."""
    from mmjax.serving.request import SamplingParams
    prompts = [*REPETITIVE, [1, 9, 9]]
    params = [SamplingParams(max_tokens=MAX_TOKENS)] * len(REPETITIVE) + [
        SamplingParams(max_tokens=6, temperature=0.9, seed=3)]
    host = _run(_engine(lm["model"], warmup=False), prompts, params)
    eng = _engine(lm["model"], proposer_on_device=True)
    compiles, seen = eng.runner.num_compiles, []
    _check_proposals(eng, seen)
    dev = _run(eng, prompts, params)
    assert [o.token_ids for o in dev[:-1]] == lm["want"] == [o.token_ids for o in host[:-1]]
    assert len(dev[-1].token_ids) == 6 and dev[-1].token_ids == host[-1].token_ids  # the same draws as well
    counts = lambda outs: [(o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens) for o in outs]  # noqa: E731
    assert counts(dev) == counts(host)
    assert sum(a for _, a in counts(dev)) > 0 and any(d > a for d, a in counts(dev))  # some accepted, some not
    assert 0 in seen and max(seen) > 0  # steps that found no match (they emit the plain token) and steps that did
    assert eng.stats()["spec_draft_tokens"] == sum(d for d, _ in counts(dev))
    assert eng.runner.num_compiles == compiles
    assert eng.runner.history.num_uploads == len(prompts)  # each history went up once, when it first speculated
    eng.kv.check_consistency()
    assert eng.kv.num_free_pages == eng.kv.num_usable_pages


def test_dynamic_speculation_with_the_device_proposer(lm):
    """serve.speculative.dynamic: plain (overlapped) steps between speculative ones add tokens the device rows
    lack; the next speculative step uploads them first, so its proposals still equal the host's lookup; greedy
    tokens equal plain greedy; nothing compiles after warm-up. The policy's choices are replaced by a fixed
    cycle (its own depend on measured times)."""
    import itertools

    from mmjax.serving.request import SamplingParams
    eng = _engine(lm["model"], proposer_on_device=True, dynamic=True)
    choices = itertools.cycle([0, 0, 0, 3, 3, 0, 0, 2, 1, 3])
    eng.policy.choose = lambda request_ids: next(choices)
    compiles, seen = eng.runner.num_compiles, []
    _check_proposals(eng, seen)
    params = [SamplingParams(max_tokens=MAX_TOKENS)] * len(REPETITIVE)
    assert [o.token_ids for o in _run(eng, REPETITIVE, params)] == lm["want"]
    st = eng.stats()
    assert st["spec_steps"] > 0 and st["spec_plain_calls"] > 0 and max(seen) > 0
    assert eng.runner.num_chained > 0  # overlapped plain steps
    assert eng.runner.history.num_uploads > len(REPETITIVE)  # rows went up again after plain steps
    assert eng.runner.num_compiles == compiles


def test_device_proposer_through_preemption(tiny, lm):
    """A pool too small for every request at once: requests are preempted while speculating and recompute;
    greedy tokens still equal plain greedy, every step's proposals the host's lookup, every page returns."""
    from mmjax.config import Config, ServeConfig
    from mmjax.serving.engine import Engine
    from mmjax.serving.request import SamplingParams
    n = 24
    want = [tiny["reference"](lm["model"], size=40).greedy(p, n, stop=()) for p in REPETITIVE]
    serve = ServeConfig(page_size=4, num_pages=24, max_num_batched_tokens=32, max_num_seqs=4, min_token_bucket=32,
                        min_slot_bucket=4, max_model_len=40, max_logprobs=0,
                        speculative=SpeculativeConfig(method="ngram", num_tokens=3, proposer_on_device=True))
    eng = Engine(Config(model=lm["model"].cfg, serve=serve), lm["model"], _Ids())
    seen = []
    _check_proposals(eng, seen)
    assert [o.token_ids for o in _run(eng, REPETITIVE, [SamplingParams(max_tokens=n)] * len(REPETITIVE))] == want
    assert eng.stats()["num_preemptions"] > 0 and max(seen) > 0
    eng.kv.check_consistency()
    assert eng.kv.num_free_pages == eng.kv.num_usable_pages


@pytest.mark.parametrize("overrides, message", [
    (["serve.speculative.proposer_on_device=true"], "needs serve.speculative.method=ngram or draft"),
    (["serve.speculative.method=ngram", "serve.speculative.proposer_on_device=3"], "must be bool")])
def test_proposer_on_device_config_is_validated(overrides, message):
    from mmjax.config import load_config
    from mmjax.errors import ConfigError
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    assert load_config(None, ["serve.speculative.method=ngram", "serve.speculative.proposer_on_device=true"]
                       ).serve.speculative.proposer_on_device
