"""kernels.bench's bookkeeping on CPU: rows from real (tiny) timings, a failing candidate, the README section."""

import jax.numpy as jnp

from mmjax.bench import kernels as bench


def test_rows_table_and_readme_section(tmp_path):
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

    readme = tmp_path / "README.md"
    readme.write_text("# Performance\n\nintro\n\n## Other section\n\nkept\n")
    bench.write_readme_section(readme, record, "cmd one")
    bench.write_readme_section(readme, record, "cmd two")  # replaces its own section, leaves the rest
    text = readme.read_text()
    assert text.count("## Kernels (`python -m mmjax.tools.bench_kernels`)") == 1
    assert "cmd two" in text and "cmd one" not in text
    assert text.startswith("# Performance\n\nintro\n\n## Other section\n\nkept\n")
