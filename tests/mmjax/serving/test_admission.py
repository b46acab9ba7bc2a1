"""Admission decisions (pure Python, a fake clock): bounded queue, token bucket with Retry-After, and TTFT
prediction refusing interactive work that would miss its target while batch work still queues."""

import dataclasses

from mmjax.config import ServeConfig
from mmjax.serving.http.admission import Admission


class Clock:
    t = 100.0

    def __call__(self):
        return self.t


def test_queue_bound_token_budget_and_ttft_prediction():
    clock = Clock()
    serve = ServeConfig(max_num_batched_tokens=64, max_num_seqs=8, max_queue_len=4, token_budget=100.0,
                        interactive_ttft_s=0.5, max_queue_wait_s=10.0)
    adm = Admission(serve, clock)
    kw = dict(queue_len=0, tokens_ahead=0, num_running=0)
    assert adm.decide("interactive", 10, 50, **kw).ok  # 60 of the 100 tokens left in the bucket
    d = adm.decide("interactive", 10, 50, **kw)
    assert not d.ok and d.reason == "token_budget" and d.retry_after == "1"  # 20 tokens short at 100/s
    clock.t += 0.2
    assert adm.decide("interactive", 10, 50, **kw).ok  # refilled 20
    full = adm.decide("batch", 1, 1, queue_len=4, tokens_ahead=0, num_running=0)
    assert not full.ok and full.reason == "queue_full"
    # no step measured yet: no prediction; then 0.1 s steps prefilling 64 - 4 running tokens each
    adm = Admission(dataclasses.replace(serve, token_budget=0.0), clock)
    assert adm.predict_wait(1000, 10, 4) is None
    adm.observe_step(0.1)
    assert adm.predict_wait(110, 10, 4) == (2 + 1) * 0.1
    late = adm.decide("interactive", 10, 10, queue_len=1, tokens_ahead=290, num_running=4)  # 6 steps: 0.6 s
    assert not late.ok and late.reason == "ttft" and late.predicted_wait_s > 0.5 and late.retry_after == "1"
    assert adm.decide("batch", 10, 10, queue_len=1, tokens_ahead=290, num_running=4).ok  # batch may wait 10 s
    assert adm.decide("interactive", 10, 10, queue_len=1, tokens_ahead=50, num_running=4).ok
