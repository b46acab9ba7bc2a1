"""GcTime counts the collections that run inside its block, by generation, and leaves no hook behind."""

import gc

from mmjax.observe.gc_time import GcTime


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
