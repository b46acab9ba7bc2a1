"""The scheduler's `preempt_for_priority`: an urgent arrival takes pages and slots from less urgent running
requests at once, which resume afterwards; equal priorities never preempt each other."""

from mmjax.serving.kv_manager import KVCacheManager
from mmjax.serving.request import Request, RequestStatus, SamplingParams
from mmjax.serving.scheduler import Scheduler


def run_step(sched, token=7):
    out = sched.schedule()
    sched.update_from_output(out, {e.request_id: token for e in out.scheduled if e.samples})
    return out


def test_urgent_arrival_preempts_less_urgent_running():
    sched = Scheduler(KVCacheManager(64, 4), max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64)
    sched.preempt_for_priority = True
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    batch = [Request(f"b{i}", list(range(10, 18)), params, priority=1000) for i in range(4)]
    for r in batch:
        sched.add_request(r)
    run_step(sched)
    assert all(r.status is RequestStatus.RUNNING for r in batch)  # every sequence slot taken
    same = Request("b-late", list(range(20, 28)), params, priority=1000)
    sched.add_request(same)
    out = run_step(sched)
    assert not out.preempted_request_ids and same.status is RequestStatus.WAITING
    urgent = Request("i0", list(range(30, 38)), params, priority=0)
    sched.add_request(urgent)
    out = run_step(sched)
    assert urgent.status is RequestStatus.RUNNING and urgent.request_id in [e.request_id for e in out.scheduled]
    assert out.preempted_request_ids == ("b3",)  # the least urgent: latest arrival of the batch priority
    assert [r.request_id for r in sched.waiting] == ["b3", "b-late"]  # back in its (priority, arrival) place
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        run_step(sched)
    assert all(len(r.output_token_ids) == 20 for r in [*batch, same, urgent])
    assert sched.num_preemptions >= 1 and sched.kv.num_free_pages == 63
