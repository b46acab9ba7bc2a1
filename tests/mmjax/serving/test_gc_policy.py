"""The serving processes raise the collector's thresholds (never lower them, never re-enable a collector that was
switched off), and an engine does so when it is built."""

import dataclasses
import gc

import pytest

from mmjax.config import Config
from mmjax.serving.engine import Engine
from mmjax.serving.gc_policy import SERVING_GC_THRESHOLDS, raise_gc_thresholds


@pytest.fixture()
def restore_gc():
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    yield
    gc.set_threshold(*thresholds)
    (gc.enable if enabled else gc.disable)()


def test_thresholds_rise_to_the_serving_ones_and_larger_ones_stay(restore_gc):
    gc.set_threshold(700, 10, 10)
    assert raise_gc_thresholds() == SERVING_GC_THRESHOLDS == gc.get_threshold()
    gc.set_threshold(10**6, 5, 1000)
    assert raise_gc_thresholds() == (10**6, SERVING_GC_THRESHOLDS[1], 1000)


def test_a_collector_switched_off_stays_off(restore_gc):
    gc.set_threshold(0, 10, 10)
    assert raise_gc_thresholds() == (0, 10, 10)
    gc.set_threshold(700, 10, 10)
    gc.disable()
    raise_gc_thresholds()
    assert not gc.isenabled() and gc.get_threshold() == (700, 10, 10)


def test_building_an_engine_raises_them(tiny, restore_gc):
    gc.set_threshold(700, 10, 10)
    model_cfg = tiny["config"]()
    serve = tiny["serve"](page_size=4, num_pages=8, max_num_batched_tokens=16, max_num_seqs=2, max_model_len=16)
    Engine(dataclasses.replace(Config(), model=model_cfg, serve=serve), tiny["model"](model_cfg), tokenizer=None)
    assert gc.get_threshold() == SERVING_GC_THRESHOLDS
