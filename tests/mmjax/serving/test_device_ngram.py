"""The on-device prompt lookup equals the host proposer (`NgramProposer.lookup`) on random histories: repeats
at several n (multiple matches: the latest wins, the longest n first), no match, histories shorter than n, a
match whose continuation is cut by the history's end; appends on the device keep equal to the host's lists."""

import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.config import SpeculativeConfig
from mmjax.serving.speculative.device_ngram import DeviceHistory, ngram_search
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


def test_device_history_appends_match_the_host():
    cfg = SpeculativeConfig(method="ngram", num_tokens=3, ngram_max=3)
    host = NgramProposer(cfg)
    dev = DeviceHistory(cfg, slots=4, max_len=32)
    rng = np.random.default_rng(1)
    lists = [rng.integers(0, 4, int(n)).tolist() for n in (3, 7, 1, 10)]
    for s, toks in enumerate(lists):
        dev.set(s, toks)
    for _ in range(5):
        new = rng.integers(0, 4, (4, 3)).astype(np.int32)
        num = rng.integers(0, 4, 4).astype(np.int32)
        dev.append(jnp.asarray(new), jnp.asarray(num))
        for s in range(4):
            lists[s] += new[s, :num[s]].tolist()
        drafts, count = (np.asarray(x) for x in dev.propose())
        for s in range(4):
            assert drafts[s, :count[s]].tolist() == host.lookup(lists[s], 3)
    assert np.asarray(dev.lengths).tolist() == [len(x) for x in lists]
