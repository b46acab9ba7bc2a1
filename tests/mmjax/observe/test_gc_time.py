"""GcTime counts the collections that run inside its block, by generation, and leaves no hook behind; process_load
counts the whole process's."""

import gc

from mmjax.observe.gc_time import GcTime, process_load


def test_counts_the_collections_inside_the_block_only():
    gc.collect()
    with GcTime() as g:
        gc.collect()  # a full collection
        gc.collect(0)
    gc.collect()  # after the block: not counted
    s = g.summary()
    assert s["gc_full_collections"] == 1 and s["gc_collections"][0] >= 1
    assert s["gc_full_ms"] >= 0 and len(s["gc_ms"]) == 3
    assert g._hook not in gc.callbacks


def test_process_load_counts_this_process_from_its_first_call():
    before = process_load()
    gc.collect()
    sum(i * i for i in range(200_000))  # some CPU time
    after = process_load()
    assert after["gc_full_collections"] >= before["gc_full_collections"] + 1
    assert after["gc_s"] > before["gc_s"] and after["cpu_s"] > before["cpu_s"]
