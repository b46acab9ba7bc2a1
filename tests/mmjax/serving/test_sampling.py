"""Sampler: greedy, seeded batch-invariant sampling, top-k/top-p/min-p, penalties, logprobs; SamplingParams."""

import numpy as np
import pytest

from mmjax.serving.request import Request, RequestError, SamplingParams
from mmjax.serving.sampling import SamplingTensors, history_len, sample

V = 16


def log_softmax(x, axis=-1):
    x = np.asarray(x, np.float64)
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def softmax(x):
    return np.exp(log_softmax(x))


def req(rid, prompt=(1, 2, 3), outputs=(), **sp):
    r = Request(rid, prompt, SamplingParams(**sp))
    r.output_token_ids.extend(outputs)
    return r


def run(logits, requests, num_slots=None, max_len=None, num_logprobs=0, seeds=None):
    num_slots = num_slots or len(requests)
    max_len = history_len(requests) if max_len is None else max_len
    t = SamplingTensors.from_requests(requests, num_slots, max_len, seeds=seeds, top_logprobs=num_logprobs)
    out = sample(np.asarray(logits, np.float32), t)
    return {k: np.asarray(v) for k, v in vars(out).items()}


def rand_logits(s, seed=0, scale=2.0):
    return (np.random.RandomState(seed).randn(s, V) * scale).astype(np.float32)


def test_greedy_is_argmax_and_padded_rows_inert():
    logits = rand_logits(4)
    out = run(logits, [req("a"), None, req("b"), None])
    np.testing.assert_array_equal(out["tokens"], logits.argmax(-1))


def draw(rid_logits_row, slot, others, step=0, seed=7, **sp):
    """Token of a seeded request placed in `slot` among `others`, all rows sharing nothing."""
    rows = [None] * 4
    for i, o in others.items():
        rows[i] = o
    r = req("x", seed=seed, temperature=1.0, **sp)
    r.output_token_ids.extend([0] * step)
    rows[slot] = r
    logits = rand_logits(4, seed=99)
    logits[slot] = rid_logits_row
    return int(run(logits, rows, max_len=8)["tokens"][slot])


def test_seeded_sampling_is_batch_and_slot_invariant():
    row = np.zeros(V, np.float32)  # uniform: every draw depends only on the key
    others = {1: req("o1", temperature=0.7, seed=3, top_k=4, repetition_penalty=1.3),
              3: req("o2", temperature=1.5, top_p=0.5, seed=11)}
    for step in range(5):
        alone = draw(row, 0, {}, step=step)
        assert draw(row, 2, others, step=step) == alone
        assert draw(row, 0, {2: req("o3", temperature=2.0, seed=5)}, step=step) == alone
    seq = [draw(row, 0, {}, step=s) for s in range(20)]
    other_seed = [draw(row, 0, {}, step=s, seed=8) for s in range(20)]
    assert seq != other_seed and len(set(seq)) > 3  # steps and seeds change the draw


def test_unseeded_request_needs_engine_seed():
    with pytest.raises(RequestError, match="no sampling seed"):
        SamplingTensors.from_requests([req("u", temperature=1.0)], 1, 0)
    a = run(rand_logits(1), [req("u", temperature=1.0)], seeds={"u": 123})["tokens"]
    b = run(rand_logits(1), [req("v", temperature=1.0, seed=123)])["tokens"]
    np.testing.assert_array_equal(a, b)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = rand_logits(6, seed=1)
    rows = [req(f"k{i}", temperature=1.5, seed=i, top_k=1) for i in range(3)]
    rows += [req(f"p{i}", temperature=1.5, seed=i, top_p=1e-6) for i in range(3)]
    np.testing.assert_array_equal(run(logits, rows)["tokens"], logits.argmax(-1))


def test_top_k_and_min_p_restrict_support():
    logits = rand_logits(1, seed=2, scale=0.5)[0]
    order = np.argsort(-logits)
    probs = softmax(logits)
    min_p = 0.3
    allowed_min_p = set(np.flatnonzero(probs >= min_p * probs.max()))
    assert 1 < len(allowed_min_p) < V
    seen_k, seen_m = set(), set()
    for s in range(60):
        rows = [req("k", temperature=1.0, seed=s, top_k=3), req("m", temperature=1.0, seed=s, min_p=min_p)]
        tk, tm = run(np.stack([logits, logits]), rows)["tokens"]
        seen_k.add(int(tk))
        seen_m.add(int(tm))
    assert seen_k == set(order[:3].tolist())
    assert seen_m <= allowed_min_p and len(seen_m) > 1


def test_top_p_keeps_the_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4), np.float32))
    seen = {int(run(logits[None], [req("p", temperature=1.0, seed=s, top_p=0.7)])["tokens"][0]) for s in range(60)}
    assert seen == {0, 1}  # 0.5 < 0.7 needs token 1 too; 0.8 covers it


def test_temperature_sampling_matches_softmax():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)
    n, temp = 8000, 0.8
    rows = [req(f"r{i}", temperature=temp, seed=1000 + i) for i in range(n)]
    wide = np.full((n, V), -np.inf, np.float32)
    wide[:, :6] = logits
    tokens = run(wide, rows)["tokens"]
    expected = softmax(logits / temp) * n
    counts = np.bincount(tokens, minlength=V)
    assert counts[6:].sum() == 0
    chi2 = ((counts[:6] - expected) ** 2 / expected).sum()
    assert chi2 < 20.5  # 5 dof: p ~ 0.001


def np_penalties(logits, prompt, outputs, rep, pres, freq):
    out = logits.astype(np.float64).copy()
    seen = set(prompt) | set(outputs)
    for t in seen:
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(outputs):
        c = outputs.count(t)
        out[t] -= pres + freq * c
    return out


@pytest.mark.parametrize("rep,pres,freq", [(1.7, 0, 0), (0.6, 0, 0), (1, 1.5, 0), (1, 0, 0.8), (1.3, -0.5, 1.2)])
def test_penalties_match_numpy_reference(rep, pres, freq):
    from mmjax.serving.sampling import apply_penalties

    logits = rand_logits(2, seed=3)
    prompt, outputs = [1, 2, 2, 5], [5, 7, 7, 7, 9]
    rows = [req("a", prompt, outputs, repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq),
            req("b", prompt, outputs)]  # no penalty: untouched even with the same history
    t = SamplingTensors.from_requests(rows, 3, 8)
    got = np.asarray(apply_penalties(np.concatenate([logits, logits[:1]]), t))
    np.testing.assert_allclose(got[0], np_penalties(logits[0], prompt, outputs, rep, pres, freq), rtol=1e-6)
    np.testing.assert_array_equal(got[1], logits[1])
    np.testing.assert_array_equal(got[2], logits[0])  # padded slot
    # greedy takes the argmax of the penalised logits
    assert run(logits, rows, max_len=8)["tokens"][0] == np.argmax(got[0])


def test_repetition_penalty_changes_greedy_choice():
    logits = np.zeros((1, V), np.float32)
    logits[0, 4], logits[0, 6] = 3.0, 2.0
    assert run(logits, [req("a", (4,))])["tokens"][0] == 4
    assert run(logits, [req("a", (4,), repetition_penalty=2.0)])["tokens"][0] == 6


def test_history_must_fit_max_len():
    with pytest.raises(RequestError, match="history_len"):
        SamplingTensors.from_requests([req("a", range(10), frequency_penalty=1.0)], 1, 4)
    SamplingTensors.from_requests([req("a", range(10))], 1, 0)  # unpenalised rows need no history


@pytest.mark.parametrize("k", [0, 5])
def test_logprobs_are_raw_log_softmax_and_sorted(k):
    logits = rand_logits(3, seed=4)
    rows = [req("a", temperature=0.7, seed=1, repetition_penalty=1.5, top_k=4), req("b"), None]
    out = run(logits, rows, num_logprobs=k)
    ref = log_softmax(logits.astype(np.float64), axis=-1)
    np.testing.assert_allclose(out["logprobs"], ref[np.arange(3), out["tokens"]], rtol=1e-5, atol=1e-6)
    assert out["top_ids"].shape == out["top_logprobs"].shape == (3, k)
    if k:
        np.testing.assert_array_equal(out["top_ids"], np.argsort(-ref, axis=-1)[:, :k])
        np.testing.assert_allclose(out["top_logprobs"], np.take_along_axis(ref, out["top_ids"], -1), rtol=1e-5)
        assert (np.diff(out["top_logprobs"], axis=-1) <= 0).all()


@pytest.mark.parametrize("field,value,needle", [
    ("temperature", -0.1, ">= 0"), ("top_k", -1, ">= 0"), ("top_p", 0.0, "(0, 1]"), ("min_p", 1.5, "[0, 1]"),
    ("repetition_penalty", 0.0, "> 0"), ("presence_penalty", 2.5, "[-2, 2]"), ("frequency_penalty", -3, "[-2, 2]"),
    ("logprobs", 21, "[0, 20]"), ("stop", ("ok", ""), "non-empty"), ("temperature", float("nan"), ">= 0"),
    ("seed", 1.5, "int"), ("include_stop_str_in_output", 1, "true or false"),
])
def test_sampling_params_validation_names_field(field, value, needle):
    with pytest.raises(RequestError, match=field) as e:
        SamplingParams(**{field: value})
    assert needle in str(e.value) and repr(value)[:3] in str(e.value)


def test_sampling_params_from_dict():
    sp = SamplingParams.from_dict({"temperature": 0.5, "stop": ["a", "b"], "stop_token_ids": [3], "logprobs": 2,
                                   "min_p": 0.1, "presence_penalty": 1})
    assert sp.stop == ("a", "b") and sp.stop_token_ids == (3,) and sp.logprobs == 2
    assert SamplingParams.from_dict({"stop": "x"}).stop == ("x",)
    with pytest.raises(RequestError, match="'temprature'"):
        SamplingParams.from_dict({"temprature": 1.0})


@pytest.mark.parametrize("vocab,k", [(20000, 8), (4097, 1), (2048, 5)])
def test_chunked_top_k_matches_lax_top_k_with_ties(vocab, k):
    """The sampler's top-k over the best slices returns lax.top_k's values and indices, ties (lower index
    first) and a ragged last slice included."""
    import jax

    from mmjax.serving.sampling import top_k

    x = np.random.default_rng(0).integers(0, 6, (3, vocab)).astype(np.float32)  # many ties
    x[1, -1] = 100.0  # the maximum in the padded last chunk
    x[2, :] = -np.inf
    x[2, 4000 % vocab] = 0.0
    want_v, want_i = jax.lax.top_k(x, k)
    got_v, got_i = top_k(x, k, chunk=128)
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
