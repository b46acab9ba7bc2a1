"""KV page pool: accounting invariants, prefix-cache hits and misses, image keys, LRU eviction."""

import os
import random
import subprocess
import sys

from mmjax.serving.kv_manager import NULL_PAGE, KVCacheManager, hash_page
from mmjax.serving.request import ExtraKey, Request, SamplingParams

PS = 4  # page size


def req(rid, tokens, extra=()):
    return Request(rid, tokens, SamplingParams(max_tokens=8), extra_keys=extra)


def admit(kv, r):
    """Take the cached prefix and room for the rest of the known tokens, as the scheduler does; then mark it
    computed and cache its full pages, as after the model step."""
    pages, cached = kv.get_computed_pages(r)
    new = kv.allocate_slots(r, r.num_tokens - cached, pages, cached)
    assert new is not None
    r.num_computed_tokens = r.num_tokens
    kv.cache_pages(r)
    return pages, cached


def test_allocate_never_hands_out_null_page_and_fails_without_side_effects():
    kv = KVCacheManager(num_pages=5, page_size=PS)
    a = req("a", range(10))
    assert kv.allocate_slots(a, 10) is not None  # 3 pages
    assert len(kv.block_table("a")) == 3 and NULL_PAGE not in kv.block_table("a")
    b = req("b", range(100, 108))
    assert kv.allocate_slots(b, 8) is None  # needs 2, 1 free
    assert kv.block_table("b") == [] and kv.num_free_pages == 1 and kv.queries == 10
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2) == []  # 12 tokens still fit 3 pages
    assert kv.allocate_slots(a, 3) == [kv.block_table("a")[-1]]  # 13 tokens: a 4th page
    assert kv.num_free_pages == 0
    a.num_computed_tokens = 16
    assert kv.allocate_slots(a, 1) is None
    kv.check_consistency()
    kv.free("a")
    assert kv.num_free_pages == kv.num_usable_pages == 4
    kv.check_consistency()


def test_random_streams_keep_page_accounting_consistent():
    rng = random.Random(0)
    kv = KVCacheManager(num_pages=24, page_size=PS)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 13))] for _ in range(4)]
    live: dict[str, Request] = {}
    for step in range(600):
        op = rng.random()
        if op < 0.35 and len(live) < 8:
            rid = f"r{step}"
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            r = req(rid, tokens)
            pages, cached = kv.get_computed_pages(r)
            assert cached < r.num_tokens
            if kv.allocate_slots(r, r.num_tokens - cached, pages, cached) is not None:
                r.num_computed_tokens = r.num_tokens
                kv.cache_pages(r)
                live[rid] = r
        elif op < 0.8 and live:
            r = live[rng.choice(sorted(live))]  # decode: one more token
            if kv.allocate_slots(r, 1) is not None:
                r.output_token_ids.append(rng.randrange(50))
                r.num_computed_tokens += 1
                kv.cache_pages(r)
        elif live:
            kv.free(live.pop(rng.choice(sorted(live))).request_id)
        kv.check_consistency()
        assert min(kv.ref_counts) >= 0
    for rid in list(live):
        kv.free(rid)
    kv.check_consistency()
    assert kv.num_free_pages == kv.num_usable_pages
    assert all(c == 0 for c in kv.ref_counts)
    assert kv.hits > 0 and kv.evictions > 0


def test_shared_prefix_hits_distinct_prefix_misses():
    kv = KVCacheManager(num_pages=32, page_size=PS)
    system = list(range(1000, 1010))  # 10 tokens: 2 full pages
    a = req("a", system + [1, 2, 3])
    assert admit(kv, a) == ([], 0)
    b = req("b", system + [7, 8])
    pages, cached = admit(kv, b)
    assert cached == 8 and pages == kv.block_table("a")[:2]
    assert kv.block_table("b")[:2] == pages and kv.ref_counts[pages[0]] == 2
    c = req("c", list(range(2000, 2013)))
    assert admit(kv, c) == ([], 0)
    assert (kv.queries, kv.hits) == (13 + 12 + 13, 8)
    kv.check_consistency()
    for rid in "abc":
        kv.free(rid)
    kv.check_consistency()
    # Freed cached pages stay hits until evicted.
    d = req("d", system + [9])
    assert admit(kv, d)[1] == 8


def test_never_the_whole_prompt_is_cached():
    kv = KVCacheManager(num_pages=16, page_size=PS)
    admit(kv, req("a", range(8)))  # exactly 2 full pages
    pages, cached = kv.get_computed_pages(req("b", range(8)))
    assert cached == 4 and len(pages) == 1  # the last token is recomputed, so its page is too
    pages, cached = kv.get_computed_pages(req("c", range(9)))
    assert cached == 8


def test_image_extra_keys_separate_identical_placeholders():
    kv = KVCacheManager(num_pages=32, page_size=PS)
    placeholders = [5, 9, 9, 9, 9, 9, 9, 9, 9, 6, 1, 2, 3]  # image at [1, 9)
    admit(kv, req("a", placeholders, [ExtraKey(1, 9, "img-A")]))
    assert kv.get_computed_pages(req("b", placeholders, [ExtraKey(1, 9, "img-B")]))[1] == 0
    assert kv.get_computed_pages(req("c", placeholders, [ExtraKey(1, 9, "img-A")]))[1] == 12
    assert kv.get_computed_pages(req("d", placeholders))[1] == 0  # no image key at all
    # Same image, placed differently inside the same tokens: a different key range misses too.
    assert kv.get_computed_pages(req("e", placeholders, [ExtraKey(2, 9, "img-A")]))[1] == 0
    # A page before the image is shared whatever the image: here the image starts in page 1.
    later = [5, 5, 5, 5, 9, 9, 9, 9, 1]
    admit(kv, req("f", later, [ExtraKey(4, 8, b"\x01")]))
    assert kv.get_computed_pages(req("g", later, [ExtraKey(4, 8, b"\x02")]))[1] == 4


def test_lru_eviction_order():
    kv = KVCacheManager(num_pages=9, page_size=PS)  # 8 usable pages
    admit(kv, req("a", range(9)))  # 3 pages: 2 full (cached) + 1 partial (plain)
    admit(kv, req("b", range(100, 109)))
    a_pages, b_pages = kv.block_table("a")[:2], kv.block_table("b")[:2]
    kv.free("a")
    kv.free("b")
    admit(kv, req("a2", range(9)))  # a hit refreshes a's pages: b's become the least recently used
    kv.free("a2")
    kv.check_consistency()
    x = req("x", range(500, 524))
    assert kv.allocate_slots(x, 20) is not None  # 5 pages: the 4 plain free ones first, then one eviction
    assert kv.evictions == 1 and b_pages[1] in kv.block_table("x")  # b's tail page goes first
    assert kv.get_computed_pages(req("b3", range(100, 109)))[1] == 4  # b's head page survives its tail
    x.num_computed_tokens = 20
    assert kv.allocate_slots(x, 4) is not None
    assert kv.evictions == 2 and b_pages[0] in kv.block_table("x")
    assert kv.get_computed_pages(req("b4", range(100, 109)))[1] == 0
    assert kv.get_computed_pages(req("a3", range(9)))[0] == a_pages
    kv.check_consistency()


def test_concurrent_identical_prefixes_compute_separately_and_stay_consistent():
    kv = KVCacheManager(num_pages=16, page_size=PS)
    a, b = req("a", range(10)), req("b", range(10))
    for r in (a, b):  # both admitted before either has computed anything: no hit
        assert kv.allocate_slots(r, 10, *kv.get_computed_pages(r)) is not None
    for r in (a, b):
        r.num_computed_tokens = 10
        kv.cache_pages(r)
    kv.check_consistency()
    assert kv.get_computed_pages(req("c", range(10)))[0] == kv.block_table("a")[:2]
    kv.free("a")
    kv.free("b")
    kv.check_consistency()
    assert kv.reset_prefix_cache() and kv.get_computed_pages(req("d", range(10)))[1] == 0
    kv.check_consistency()


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_pages=16, page_size=PS, enable_prefix_caching=False)
    admit(kv, req("a", range(10)))
    assert kv.get_computed_pages(req("b", range(10))) == ([], 0)
    kv.free("a")
    assert kv.num_free_pages == kv.num_usable_pages
    kv.check_consistency()


def test_hash_is_stable_across_processes_and_typed():
    page = [1, 2, 3, 4]
    assert hash_page(b"", page, [(0, 2, "img")]) != hash_page(b"", page, [(0, 2, b"img")])
    assert hash_page(b"", page, [(0, 2, 1)]) != hash_page(b"", page, [(0, 2, "1")])
    assert hash_page(b"", page) != hash_page(hash_page(b"", page), page)
    code = ("from mmjax.serving.kv_manager import hash_page; "
            "print(hash_page(b'seed', [1, 2, 3, 4], [(0, 2, 'img'), (1, 3, 7)]).hex())")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONHASHSEED": "123"}
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert other.stdout.strip() == hash_page(b"seed", [1, 2, 3, 4], [(0, 2, "img"), (1, 3, 7)]).hex()
