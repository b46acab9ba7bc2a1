"""Beam search and speculation in the scheduler with a fake model (pure Python): a simulated device pool that
applies the step's page copies and writes shows every row reading exactly its own tokens (copy-on-write is
right), preemption restarts a search without changing its result, and every page returns."""

import zlib

import numpy as np

from mmjax.serving.kv_manager import KVCacheManager
from mmjax.serving.request import Request, SamplingParams
from mmjax.serving.scheduler import Scheduler

V, PAGE = 32, 4


def candidates(tokens, k=8):
    """Deterministic top-k log-probabilities of a sequence (the fake model)."""
    rng = np.random.default_rng(zlib.crc32(np.asarray(tokens, np.int64).tobytes()))
    lp = np.log(rng.dirichlet(np.full(V, 0.3)))
    ids = np.argsort(-lp)[:k]
    return tuple(int(i) for i in ids), tuple(float(x) for x in lp[ids])


def greedy(seq):
    return candidates(seq)[0][0]


def propose(request, rng, k=3):
    """The fake model's own greedy continuation, each guess wrong with probability 1/3."""
    seq, out = list(request.all_token_ids), []
    for _ in range(k):
        tok = greedy(seq) if rng.random() > 1 / 3 else int(rng.integers(8, V))
        out.append(tok)
        seq.append(tok)
    return out


def run(num_pages, jobs, max_seqs=8, speculate=False):
    kv = KVCacheManager(num_pages, PAGE)
    sched = Scheduler(kv, max_num_batched_tokens=16, max_num_seqs=max_seqs, max_model_len=40)
    requests = [Request(f"r{i}", prompt, sp, eos_token_id=7, arrival_time=float(i))
                for i, (prompt, sp) in enumerate(jobs)]
    for r in requests:
        sched.add_request(r)
    pool: dict[int, list] = {}  # page -> the token written at each slot
    copies = 0
    rng = np.random.default_rng(1)
    while sched.has_unfinished_requests():
        if speculate:
            from mmjax.serving.speculative.proposers import decoding
            for r in sched.running:
                if decoding(r):
                    r.spec_token_ids = propose(r, rng)
        out = sched.schedule()
        for src, dst in out.page_copies:
            pool[dst] = list(pool.get(src, [None] * PAGE))
            copies += 1
        sampled, cands = {}, {}
        for e in out.scheduled:
            if e.owner:
                root = sched.requests[e.owner]
                row = next(r for r in root.beam.rows if r.request_id == e.request_id)
                seq = row.all_token_ids
            else:
                seq = sched.requests[e.request_id].all_token_ids + list(e.token_ids[e.num_tokens - e.num_draft:])
            for j, tok in enumerate(e.token_ids):  # write, then check what attention would read
                p = e.start + j
                pool.setdefault(e.page_ids[p // PAGE], [None] * PAGE)[p % PAGE] = tok
            end = e.start + e.num_tokens
            assert [pool[e.page_ids[p // PAGE]][p % PAGE] for p in range(end)] == seq[:end], e.request_id
            if e.num_draft:  # greedy verification: the longest agreeing prefix, then the model's token
                base = len(seq) - e.num_draft
                emitted = []
                for i in range(e.num_draft + 1):
                    emitted.append(greedy(seq[:base + i]))
                    if i == e.num_draft or emitted[-1] != seq[base + i]:
                        break
                sampled[e.request_id] = emitted
            elif e.samples:
                cands[e.request_id] = candidates(seq)
                sampled[e.request_id] = cands[e.request_id][0][0]
        sched.update_from_output(out, sampled, cands)
        kv.check_consistency()
    assert kv.num_free_pages == kv.num_usable_pages and not any(kv.ref_counts)
    return {r.request_id: (r.output_token_ids, r.beam.results if r.beam else None) for r in requests}, sched, copies


def test_beams_read_their_own_tokens_and_survive_preemption():
    rng = np.random.default_rng(0)
    jobs = []
    for i in range(6):
        prompt = rng.integers(8, V, int(rng.integers(3, 11))).tolist()
        if i % 2 == 0:
            sp = SamplingParams(max_tokens=int(rng.integers(5, 12)), use_beam_search=True, best_of=3, n=2,
                                length_penalty=float(rng.choice([0.0, 1.0, 2.0])))
        else:
            sp = SamplingParams(max_tokens=int(rng.integers(3, 9)))
        jobs.append((prompt, sp))
    roomy, _, copies = run(200, jobs)
    assert copies > 0  # beams forked inside partly filled pages
    tight, sched, _ = run(13, jobs)
    assert sched.num_preemptions > 0
    assert tight == roomy
    # speculation (wrong guesses included) changes no greedy output, with or without preemption
    for pages in (200, 13):
        spec, sched, _ = run(pages, jobs, speculate=True)
        assert spec == roomy
        assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens


def test_adaptive_draft_length():
    from mmjax.config import SpeculativeConfig
    from mmjax.serving.speculative.proposers import DraftLength
    length = DraftLength(SpeculativeConfig(method="ngram", num_tokens=4, adaptive=True))
    r = Request("a", [5, 6], SamplingParams())
    ks = []
    for drafted, accepted in [(0, 0), (4, 1), (7, 1), (9, 3), (12, 6), (12, 6)]:  # per step: 1/4, 0/3, 2/2, 3/3
        r.num_draft_tokens, r.num_accepted_tokens = drafted, accepted
        ks.append(length(r))
    assert ks == [4, 3, 2, 3, 4, 4]
    length.keep_only(set())
    assert length(r) == 4 and DraftLength(SpeculativeConfig(num_tokens=3))(r) == 3
