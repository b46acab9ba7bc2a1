"""The load generator's requests: lengths within the served context, logprobs asked for only when the spec says so."""

import numpy as np

from mmjax.bench.loadgen import LoadSpec, make_requests, process_busy

CARD = {"id": "m", "max_model_len": 256, "vocab_size": 500, "image_tokens": 9}


def test_requests_fit_the_context_and_ask_logprobs_only_when_told():
    for logprobs in (True, False):
        spec = LoadSpec(num_requests=12, image_every=3, logprobs=logprobs)
        reqs = make_requests(spec, CARD, np.random.default_rng(0))
        assert len(reqs) == 12 and {p for p, _ in reqs} == {"/v1/completions", "/v1/chat/completions"}
        for path, body in reqs:
            assert ("logprobs" in body) == logprobs and body["stream_options"] == {"include_usage": True}
            if path == "/v1/completions":
                assert len(body["prompt"]) + body["max_tokens"] <= CARD["max_model_len"] - 1


def test_process_busy_is_per_second_and_per_output_token():
    before = {"api": {"cpu_seconds": 1.0, "gc_seconds": 0.0, "gc_full_collections": 2.0}}
    after = {"api": {"cpu_seconds": 3.0, "gc_seconds": 0.5, "gc_full_collections": 3.0},
             "engine": {"cpu_seconds": 9.0, "gc_seconds": 0.0, "gc_full_collections": 0.0}}
    busy = process_busy(before, after, duration=4.0, output_tokens=1000)
    assert busy == {"api": {"cpu_cores": 0.5, "cpu_us_per_output_token": 2000.0, "gc_full_collections": 1.0,
                            "gc_s": 0.5}}  # the engine's counters were not there before: no row
