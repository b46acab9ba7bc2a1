"""Dynamic speculation's cost model with given step times: it speculates where the expected tokens per second
win and turns itself off where they lose (large batches, low acceptance); the config knobs are validated."""

import numpy as np
import pytest

from mmjax.config import SpeculativeConfig
from mmjax.errors import ConfigError
from mmjax.serving.speculative.policy import SpeculationPolicy, batch_bucket, expected_tokens

K = 4


def policy(acceptance, plain_step_s, spec_step_s, batch, probe_every=0):
    """A policy fed step times (each key twice: the first sample is dropped) and `batch` requests of the given
    acceptance (measured over many steps at k = K)."""
    p = SpeculationPolicy(SpeculativeConfig(method="ngram", num_tokens=K, dynamic=True, dynamic_ema=0.5,
                                            dynamic_probe_every=probe_every))
    ids = [f"r{i}" for i in range(batch)]
    for _ in range(2):
        p.record_plain(batch, plain_step_s * 8, steps=8)  # a call of 8 decode steps
        for k in range(1, K + 1):
            p.record_spec(batch, k, spec_step_s(k))
    rng = np.random.default_rng(0)
    for rid in ids:
        for _ in range(200):  # each proposal accepted with probability `acceptance` after the ones before it
            accepted = 0
            while accepted < K and rng.random() < acceptance:
                accepted += 1
            p.record_acceptance(rid, K, accepted)
    return p, ids


def test_expected_tokens_is_the_geometric_sum():
    a = np.array([0.0, 0.3, 0.8, 0.999])
    for k in range(5):
        np.testing.assert_allclose(expected_tokens(a, k), (1 - a ** (k + 1)) / (1 - a))
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]


def test_policy_speculates_where_it_wins_and_switches_off_where_it_loses():
    # batch 1, memory bound: verifying k more tokens costs little; acceptance 0.7 -> speculate, at the largest k
    p, ids = policy(0.7, 0.010, lambda k: 0.011 + 0.0005 * k, batch=1)
    assert 0.6 < p.acceptance("r0") < 0.8
    assert p.choose(ids) == K
    # the same costs with acceptance 0.05: each step emits ~1.05 tokens, not worth 11 ms over 10 ms -> off
    p, ids = policy(0.05, 0.010, lambda k: 0.011 + 0.0005 * k, batch=1)
    assert p.choose(ids) == 0
    # batch 64, compute bound: a step of k + 1 tokens per request costs k + 1 plain steps -> off at any acceptance
    p, ids = policy(0.9, 0.020, lambda k: 0.020 * (k + 1), batch=64)
    assert p.choose(ids) == 0
    # in between the best k is interior: the cost grows steeply past k = 2
    p, ids = policy(0.6, 0.010, lambda k: [0, 0.012, 0.013, 0.030, 0.040][k], batch=4)
    rates = p.rates(ids)
    assert p.choose(ids) == max(rates, key=rates.get) == 2


def test_policy_measures_plain_first_explores_each_k_and_probes_while_off():
    p = SpeculationPolicy(SpeculativeConfig(method="ngram", num_tokens=2, dynamic=True, dynamic_probe_every=3))
    ids = ["a", "b"]
    assert p.choose(ids) == 0  # nothing measured: the plain fast path first
    p.record_plain(2, 0.08, 8)
    assert p.choose(ids) == 0  # the first sample of a key is dropped (it may hold a compile)
    p.record_plain(2, 0.08, 8)
    assert p.choose(ids) == 2  # then each unmeasured k, the largest first
    for k in (2, 2, 1, 1):
        p.record_spec(2, k, 0.05)  # far slower than 10 ms per plain step
    for rid in ids:
        p.record_acceptance(rid, 2, 1)
    assert [p.choose(ids) for _ in range(2)] == [0, 0]
    assert p.choose(ids) > 0  # the 3rd step off probes, once, measured or not (a step that also prefills is not)
    assert [p.choose(ids) for _ in range(3)] == [0, 0, 2]  # so speculation that loses costs 1 step in 3
    assert p.seconds(3, 0) is None and p.seconds(2, 0) == pytest.approx(0.01)  # 3 requests: bucket 4
    p.drop("a")
    assert p.acceptance("a") == pytest.approx(p.acceptance("zzz"))  # forgotten: the average over all requests


@pytest.mark.parametrize("kw, message", [
    (dict(method="none", dynamic=True), "needs serve.speculative.method"),
    (dict(method="ngram", dynamic=True, dynamic_ema=0.0), "dynamic_ema"),
    (dict(method="ngram", dynamic=True, dynamic_prior_acceptance=1.0), "dynamic_prior_acceptance"),
    (dict(method="ngram", dynamic=True, dynamic_probe_every=-1), "dynamic_probe_every")])
def test_dynamic_config_is_validated(kw, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig(**kw).validate()
