"""kernels.bench's bookkeeping on CPU: rows from real (tiny) timings, a failing candidate, the latest.json values."""

import jax.numpy as jnp

from mmjax.bench import kernels as bench


def test_rows_table_and_latest_values():
    rows = []
    bench.bench_norms(rows, n=64, e=128, dtype=jnp.float32, impls=("xla",))
    assert [r.op for r in rows] == ["rms_norm_fwd", "rms_norm_fwd_bwd", "add_rms_norm_fwd", "add_rms_norm_fwd_bwd",
                                    "layer_norm_fwd", "layer_norm_fwd_bwd"]
    assert all(r.ms > 0 and r.gbps > 0 and r.fraction == r.gbps / bench.PEAK_GBPS for r in rows)
    # a candidate that raises becomes a row with the error instead of ending the run
    bench.time_row(rows, "x", "broken", "[1]", lambda: (_ for _ in ()).throw(RuntimeError("line one\nline | two")), ())
    assert rows[-1].ms is None and rows[-1].note.startswith("failed: RuntimeError: line one")

    record = {"device": "cpu", "date": "today", "versions": {}, "ceilings": {}, "rows": [r.as_dict() for r in rows]}
    table = bench.table(record).splitlines()
    assert len(table) == 2 + len(rows)  # the multi-line error stays in one row
    assert table[-1].endswith("failed: RuntimeError: line one line / two |") and table[-1].count("|") == 10

    # latest.json's kernels rows: the fastest non-peer implementation at the headline shape, the row kernels' share
    shape = bench.HEADLINE_ATTENTION
    fake = [{"op": "attention_fwd", "impl": impl, "shape": shape, "ms": 1.0, "tflops": t, "fraction_of_ceiling": None}
            for impl, t in (("pallas", 300.0), ("mgpu", 500.0), ("torch_sdpa", 900.0))]
    fake.append({"op": "rms_norm_fwd_bwd", "impl": "pallas", "shape": "[32768,4096] bfloat16", "ms": 1.0,
                 "tflops": None, "fraction_of_ceiling": 0.9371})
    values = bench.latest_values({"rows": fake}, source="k.json")
    assert values == {"attention_fwd_tflops": {"value": 500.0, "source": "k.json", "label":
                                               "causal attention fwd, B4 S4096 H16 D128 bf16 (mgpu)"},
                      "rms_norm_fwd_bwd_of_copy": {"value": 0.937, "source": "k.json"}}
    assert bench.latest_values(record) == {}  # a run without those sections updates nothing
