"""Scheduler: token budget and chunked prefill, priorities, preemption, stop conditions, aborts, and a simulated
engine whose outputs must not depend on how requests were batched, chunked, cached or preempted."""

import random
import zlib

import pytest

from mmjax.errors import ConfigError
from mmjax.serving.kv_manager import NULL_PAGE, KVCacheManager
from mmjax.serving.request import ExtraKey, Request, RequestError, RequestStatus, SamplingParams
from mmjax.serving.scheduler import Scheduler

EOS, VOCAB = 1, 64


def make(num_pages=64, page_size=4, budget=16, max_seqs=8, max_len=128, **kw):
    return Scheduler(KVCacheManager(num_pages, page_size), max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                     max_model_len=max_len, **kw)


def image_key_at(request, pos):
    for k in request.extra_keys:
        if k.start <= pos < k.end:
            return k.key
    return None


def next_token(context):
    """The fake model: a token from the whole context (token ids and image keys), as attention would see it."""
    return zlib.crc32(repr(context).encode()) % VOCAB


class FakeRunner:
    """Simulates the device KV pages: writes each computed token (with its image key) to the slot its page table
    gives, and samples from the context read back through the page table. A wrong page id, position, prefix-cache
    hit or stale page after preemption changes the context, hence the tokens."""

    def __init__(self, sched):
        self.sched, self.ps = sched, sched.kv.page_size
        self.pages, self.requests = {}, {}

    def step(self, out):
        for rid in out.finished_request_ids:
            self.requests.pop(rid, None)
        self.requests.update((r.request_id, r) for r in out.new_requests)
        sampled = {}
        for e in out.scheduled:
            req = self.requests[e.request_id]
            end = e.start + e.num_tokens
            assert NULL_PAGE not in e.page_ids and len(e.page_ids) == -(-end // self.ps)
            assert list(e.token_ids) == req.all_token_ids[e.start:end]
            for j, tok in enumerate(e.token_ids):
                pos = e.start + j
                self.pages.setdefault(e.page_ids[pos // self.ps], {})[pos % self.ps] = (tok, image_key_at(req, pos))
            if e.samples:
                assert end == req.num_tokens
                context = [self.pages[e.page_ids[p // self.ps]][p % self.ps] for p in range(end)]
                sampled[e.request_id] = next_token(context)
        return sampled


def reference(request, max_len):
    """What the request generates when run alone, without paging or caching."""
    context = [(t, image_key_at(request, p)) for p, t in enumerate(request.prompt_token_ids)]
    params, out = request.sampling_params, []
    while True:
        tok = next_token(context)
        out.append(tok)
        context.append((tok, None))
        if (tok == request.eos_token_id and not params.ignore_eos) or tok in params.stop_token_ids:
            return out
        if len(out) >= params.max_tokens or len(context) >= max_len:
            return out


def run(sched, max_steps=1000, on_step=None):
    runner, finished = FakeRunner(sched), []
    for step in range(max_steps):
        if on_step is not None:
            on_step(step)
        if not sched.has_unfinished_requests():
            return finished
        out = sched.schedule()
        assert 0 < out.num_scheduled_tokens <= sched.limits.max_num_batched_tokens  # always progress, never over budget
        finished += sched.update_from_output(out, runner.step(out))
        sched.kv.check_consistency()
    raise AssertionError("requests never finished")


def test_chunked_prefill_respects_budget_and_mixes_decode_with_prefill():
    sched = make(budget=8)
    sched.add_request(Request("short", range(10, 13), SamplingParams(max_tokens=10), arrival_time=0))
    out = sched.schedule()
    assert [(e.request_id, e.start, e.num_tokens, e.samples) for e in out.scheduled] == [("short", 0, 3, True)]
    assert [r.request_id for r in out.new_requests] == ["short"]
    runner = FakeRunner(sched)
    sched.update_from_output(out, runner.step(out))
    sched.add_request(Request("long", range(100, 120), SamplingParams(max_tokens=4), arrival_time=1))
    shapes = []
    for _ in range(3):
        out = sched.schedule()
        assert out.num_scheduled_tokens <= 8
        shapes.append([(e.request_id, e.start, e.num_tokens, e.samples) for e in out.scheduled])
        sched.update_from_output(out, runner.step(out))
    assert shapes == [[("short", 3, 1, True), ("long", 0, 7, False)],  # decode first, then a prefill chunk
                      [("short", 4, 1, True), ("long", 7, 7, False)],
                      [("short", 5, 1, True), ("long", 14, 6, True)]]
    assert len(sched.requests["long"].output_token_ids) == 1


def test_long_prefill_threshold_caps_chunks():
    sched = make(budget=64, long_prefill_token_threshold=5)
    sched.add_request(Request("a", range(12), SamplingParams(max_tokens=2)))
    sched.add_request(Request("b", range(50, 53), SamplingParams(max_tokens=2)))
    out = sched.schedule()
    assert [(e.request_id, e.num_tokens) for e in out.scheduled] == [("a", 5), ("b", 3)]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step():
    sched = make(budget=128, enable_chunked_prefill=False)
    sched.add_request(Request("a", range(100), SamplingParams(max_tokens=3)))
    sched.add_request(Request("b", range(200, 240), SamplingParams(max_tokens=3)))
    out = sched.schedule()
    assert [(e.request_id, e.num_tokens) for e in out.scheduled] == [("a", 100)]  # b does not fit the remaining 28
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        make(budget=16, enable_chunked_prefill=False)


def test_priority_then_arrival_order_and_max_num_seqs():
    sched = make(max_seqs=2)
    for rid, prio, t in [("late", 0, 3.0), ("low", 5, 0.0), ("early", 0, 1.0), ("urgent", -1, 2.0)]:
        sched.add_request(Request(rid, range(3), SamplingParams(max_tokens=1), arrival_time=t, priority=prio))
    out = sched.schedule()
    assert [e.request_id for e in out.scheduled] == ["urgent", "early"]
    sched.update_from_output(out, FakeRunner(sched).step(out))  # both finish (max_tokens=1)
    out = sched.schedule()
    assert [e.request_id for e in out.scheduled] == ["late", "low"]
    assert set(out.finished_request_ids) == {"urgent", "early"}


def test_preemption_frees_pages_and_the_request_resumes_with_the_right_tokens():
    # 8 usable pages of 4 tokens: two requests of 10 prompt + 12 output tokens cannot both finish in place.
    sched = make(num_pages=9, budget=32)
    reqs = [Request(f"r{i}", range(20 * i, 20 * i + 10), SamplingParams(max_tokens=12, ignore_eos=True),
                    arrival_time=i) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    seen_preempted = []
    runner = FakeRunner(sched)
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        seen_preempted += out.preempted_request_ids
        if "r1" in out.resumed_request_ids:
            assert sched.requests["r1"].num_computed_tokens == next(
                e.start for e in out.scheduled if e.request_id == "r1")
        sched.update_from_output(out, runner.step(out))
        sched.kv.check_consistency()
    assert seen_preempted == ["r1"]  # the later arrival is the victim
    assert reqs[1].num_preemptions == 1 and reqs[0].num_preemptions == 0 and sched.num_preemptions == 1
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == reference(r, 128) and len(r.output_token_ids) == 12
    assert sched.kv.num_free_pages == sched.kv.num_usable_pages


def test_priority_decides_the_preemption_victim():
    sched = make(num_pages=9, budget=32)
    first = Request("first", range(10), SamplingParams(max_tokens=12, ignore_eos=True), arrival_time=0, priority=3)
    second = Request("second", range(50, 60), SamplingParams(max_tokens=12, ignore_eos=True), arrival_time=1)
    sched.add_request(first)
    sched.add_request(second)
    run(sched)
    assert first.num_preemptions >= 1 and second.num_preemptions == 0
    assert first.output_token_ids == reference(first, 128)


def test_stop_conditions():
    prompt = list(range(5))
    natural = reference(Request("x", prompt, SamplingParams(max_tokens=50, ignore_eos=True)), 128)
    stop_tok = natural[3]
    cases = {
        "eos": Request("eos", prompt, SamplingParams(max_tokens=50), eos_token_id=natural[2]),
        "stop": Request("stop", prompt, SamplingParams(max_tokens=50, stop_token_ids=(stop_tok,))),
        "ignore": Request("ignore", prompt, SamplingParams(max_tokens=6, ignore_eos=True), eos_token_id=natural[2]),
        "maxlen": Request("maxlen", prompt, SamplingParams(max_tokens=50, ignore_eos=True)),
    }
    sched = make(max_len=12)
    for r in cases.values():
        sched.add_request(r)
    run(sched)
    first_stop = natural.index(stop_tok)
    assert cases["eos"].output_token_ids == natural[:natural.index(natural[2]) + 1]
    assert cases["eos"].status is RequestStatus.FINISHED_STOPPED and cases["eos"].stop_reason == natural[2]
    assert cases["stop"].output_token_ids == natural[:first_stop + 1]
    assert cases["stop"].status is RequestStatus.FINISHED_STOPPED
    assert cases["ignore"].output_token_ids == natural[:6] and cases["ignore"].status is RequestStatus.FINISHED_LENGTH
    assert cases["maxlen"].output_token_ids == natural[:7]  # 5 + 7 = max_model_len
    assert cases["maxlen"].status is RequestStatus.FINISHED_LENGTH
    for r in cases.values():
        assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.finished_time


def test_prefix_cache_shared_by_later_requests():
    sched = make(budget=64)
    system = list(range(30, 46))  # 4 pages
    a = Request("a", system + [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add_request(a)
    run(sched)
    b = Request("b", system + [3], SamplingParams(max_tokens=2, ignore_eos=True))
    c = Request("c", list(range(300, 317)), SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add_request(b)
    sched.add_request(c)
    out = sched.schedule()
    assert {e.request_id: e.start for e in out.scheduled} == {"b": 16, "c": 0}
    assert (b.num_cached_tokens, c.num_cached_tokens) == (16, 0)
    assert sched.stats()["prefix_cache_hits"] == 16


def test_abort_frees_pages_whenever_it_happens():
    sched = make(budget=8)
    for i in range(3):
        sched.add_request(Request(f"r{i}", range(10 * i, 10 * i + 12), SamplingParams(max_tokens=5), arrival_time=i))
    runner = FakeRunner(sched)
    out = sched.schedule()  # r0 gets 8 tokens, the others wait
    assert sched.abort_request("r2")  # waiting
    sched.update_from_output(out, runner.step(out))
    out = sched.schedule()
    assert [e.request_id for e in out.scheduled] == ["r0", "r1"] and "r2" in out.finished_request_ids
    assert sched.abort_request("r1")  # running, between schedule and update
    sched.update_from_output(out, runner.step(out))
    assert not sched.abort_request("r1") and not sched.abort_request("nope")
    sched.kv.check_consistency()
    assert sched.kv.block_table("r1") == []
    assert sched.abort_request("r0")
    assert sched.kv.num_free_pages == sched.kv.num_usable_pages and not sched.has_unfinished_requests()
    assert sched.schedule().finished_request_ids == ("r1", "r0")


def test_bad_requests_raise_and_leave_others_alone():
    sched = make(num_pages=9, max_len=64)  # 8 pages of 4 tokens = 32 tokens of KV
    good = Request("good", range(8), SamplingParams(max_tokens=4))
    sched.add_request(good)
    with pytest.raises(RequestError, match="empty prompt"):
        Request("e", [], SamplingParams())
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(RequestError, match="max_model_len"):
        sched.add_request(Request("long", range(64), SamplingParams()))
    with pytest.raises(RequestError, match="KV pages"):
        sched.add_request(Request("huge", range(40), SamplingParams(max_tokens=1)))
    with pytest.raises(RequestError, match="KV pages"):  # fits as a prompt, not with its outputs
        sched.add_request(Request("grows", range(20), SamplingParams(max_tokens=20)))
    sched.add_request(Request("edge", range(20), SamplingParams(max_tokens=13)))  # 32 tokens of KV at most
    with pytest.raises(RequestError, match="already in use"):
        sched.add_request(Request("good", range(3), SamplingParams()))
    with pytest.raises(RequestError, match="extra key"):
        Request("img", range(4), SamplingParams(), extra_keys=[ExtraKey(2, 9, "x")])
    assert list(sched.requests) == ["good", "edge"]
    run(sched)
    assert good.output_token_ids == reference(good, 64)


@pytest.mark.parametrize("caching,chunked,threshold", [(True, True, 0), (True, True, 6), (False, True, 0),
                                                       (True, False, 0)])
def test_simulated_engine_outputs_match_running_alone(caching, chunked, threshold):
    rng = random.Random(1)
    # 20 pages of 4 tokens for up to 6 requests of up to 48 tokens: preemptions are certain.
    sched = Scheduler(KVCacheManager(21, 4, enable_prefix_caching=caching),
                      max_num_batched_tokens=20 if chunked else 48, max_num_seqs=6, max_model_len=48,
                      enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold)
    systems = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (9, 16)]
    image = [60] * 6  # placeholder ids: the same for every image
    pending = []
    for i in range(36):
        prompt, extra = [], []
        if rng.random() < 0.6:
            prompt += rng.choice(systems)
        if rng.random() < 0.4:
            extra.append(ExtraKey(len(prompt), len(prompt) + len(image), f"img{rng.randrange(3)}"))
            prompt += image
        prompt += [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 12))]
        params = SamplingParams(max_tokens=rng.randrange(1, 24), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=(rng.randrange(2, VOCAB),) if rng.random() < 0.2 else ())
        pending.append(Request(f"r{i}", prompt, params, eos_token_id=EOS, arrival_time=i, priority=rng.randrange(2),
                               extra_keys=extra))
    arrivals = sorted(rng.sample(range(60), len(pending)))  # many arrive while others decode
    mixed, partial = [], []

    def arrive(step):
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            sched.add_request(pending[len(pending) - len(arrivals) - 1])

    real_schedule = sched.schedule

    def schedule():
        out = real_schedule()
        prefill = any(not e.samples or e.num_tokens > 1 for e in out.scheduled)
        decode = any(e.num_tokens == 1 and e.start >= sched.requests[e.request_id].num_prompt_tokens
                     for e in out.scheduled)
        mixed.append(prefill and decode)
        partial.append(any(not e.samples for e in out.scheduled))
        return out

    sched.schedule = schedule
    finished = run(sched, on_step=arrive)
    assert not arrivals and len(finished) == len(pending)
    for r in pending:
        assert r.output_token_ids == reference(r, 48), r.request_id
        assert r.status.is_finished and r.finished_time is not None
    assert sched.num_preemptions > 0 and any(mixed) and any(partial) == chunked
    assert (sched.kv.hits > 0) == caching
    assert sched.kv.num_free_pages == sched.kv.num_usable_pages and all(c == 0 for c in sched.kv.ref_counts)


def _decoding(sched, n, max_tokens=20, **params):
    """n requests past their prompts (one prefill step each, tokens given), ready for multi-step decode."""
    reqs = [Request(f"r{i}", [5 + i] * 6, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))
            for i in range(n)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, {e.request_id: 7 for e in out.scheduled})
    return reqs


def test_schedule_chained_continues_where_the_running_call_ends():
    sched = make(budget=64, decode_steps=4)
    reqs = _decoding(sched, 3, max_tokens=9)
    prev = sched.schedule()
    assert [e.num_steps for e in prev.scheduled] == [4, 4, 4]
    free = sched.kv.num_free_pages
    nxt = sched.schedule_chained(prev)
    # each request has 1 + 4 tokens after prev, 4 more to max_tokens=9: KV positions 10..13, a fourth page
    assert [(e.start, e.num_steps, e.chained, e.token_ids) for e in nxt.scheduled] == [(10, 4, True, (-1,))] * 3
    assert sched.kv.num_free_pages == free - 3 and all(len(e.page_ids) == 4 for e in nxt.scheduled)
    # prev's tokens arrive; r1 stops on a stop token inside prev: the chained entry is skipped, its pages freed
    reqs[1].sampling_params = SamplingParams(max_tokens=9, ignore_eos=True, stop_token_ids=(9,))
    sched.update_from_output(prev, {"r0": [8] * 4, "r1": [8, 9, 8, 8], "r2": [8] * 4})
    assert reqs[1].status is RequestStatus.FINISHED_STOPPED and reqs[1].output_token_ids == [7, 8, 9]
    sched.update_from_output(nxt, {"r0": [3] * 4, "r2": [3] * 4})
    assert reqs[0].status is RequestStatus.FINISHED_LENGTH and reqs[0].output_token_ids == [7] + [8] * 4 + [3] * 4
    sched.kv.check_consistency()
    assert sched.kv.num_free_pages == sched.kv.num_usable_pages


@pytest.mark.parametrize("case", ["penalty", "waiting", "single_steps", "pages"])
def test_schedule_chained_refuses_what_it_cannot_predict(case):
    pages = {"pages": 10}.get(case, 64)  # prev fills the 9 usable pages (3 requests x 3); the next call needs 3 more
    sched = make(budget=64, num_pages=pages, max_seqs=4, decode_steps=1 if case == "single_steps" else 4)
    _decoding(sched, 3, **({"repetition_penalty": 1.2} if case == "penalty" else {}))
    prev = sched.schedule()
    if case == "waiting":  # arrives while prev runs, and a sequence slot is free for it
        sched.add_request(Request("late", [9] * 6, SamplingParams(max_tokens=5)))
    free = sched.kv.num_free_pages
    assert not prev.preempted_request_ids and (case == "single_steps") == (prev.scheduled[0].num_steps == 1)
    assert sched.schedule_chained(prev) is None
    assert sched.kv.num_free_pages == free  # nothing allocated
