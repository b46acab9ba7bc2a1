"""`observe.hlo_sources` and `tools.kernel_sources`: XLA kernels named back to the jax ops and source lines fused
into them, from a real compiled program's optimized HLO."""

from __future__ import annotations

import inspect
import json

import jax
import jax.numpy as jnp
import pytest

from mmjax.observe.hlo_sources import fusion_sources, kernel_name, kernel_sources
from mmjax.tools import kernel_sources as tool


def _program(x, y):
    a = jnp.sin(x) * 2 + y
    return jnp.sum(a, axis=1), jnp.pad(a, ((0, 3), (0, 0)))


@pytest.fixture(scope="module")
def hlo() -> str:
    return jax.jit(_program).lower(jnp.ones((8, 16)), jnp.ones((8, 16))).compile().as_text()


def test_each_fusion_lists_the_ops_and_lines_it_holds(hlo):
    fusions = fusion_sources(hlo)
    first = inspect.getsourcelines(_program)[1]
    body, ret = f"{__file__}:{first + 1} (_program)", f"{__file__}:{first + 2} (_program)"
    pads = [f for f in fusions.values() if "pad" in f.op_names]
    sums = [f for f in fusions.values() if "reduce_sum" in f.op_names]
    assert pads and sums and not set(f.kernel for f in pads) & set(f.kernel for f in sums)
    for f in pads + sums:
        assert {"sin", "mul", "add"} <= set(f.op_names)  # the elementwise body is fused into both consumers
        assert f.sources[body] >= 3 and f.sources[ret] >= 1
        assert f.kernel == kernel_name(f.instruction) and "." not in f.kernel


def test_profile_rows_get_the_fusions_ops_per_step(hlo):
    fusions = fusion_sources(hlo)
    name = next(k for k, f in fusions.items() if "pad" in f.op_names)
    rows = kernel_sources([{"name": name, "total_ms": 4.0, "count": 8},
                           {"name": "mmjax_norm_fwd", "total_ms": 2.0, "count": 4}], fusions, steps=2)
    assert rows[0]["ms_per_step"] == 2.0 and rows[0]["per_step"] == 4.0 and "pad" in rows[0]["ops"]
    assert rows[0]["sources"] and rows[1]["ops"] == [] and rows[1]["sources"] == []  # not an XLA fusion


def test_older_dumps_with_source_file_metadata():
    text = """HloModule m

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %exp.1 = f32[4]{0} exponential(%p), metadata={op_name="jit(f)/exp" source_file="/src/model.py" source_line=12}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %loop_exponential_fusion.3 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation
}
"""
    f = fusion_sources(text)["loop_exponential_fusion_3"]
    assert dict(f.op_names) == {"exp": 1} and dict(f.sources) == {"/src/model.py:12": 1}


def test_cli_joins_a_serving_profile_and_rejects_text_without_fusions(hlo, tmp_path, capsys):
    fusions = fusion_sources(hlo)
    name = next(iter(fusions))
    hlo_file, result = tmp_path / "m.after_optimizations.txt", tmp_path / "result.json"
    hlo_file.write_text(hlo)
    profile = {"steps": 2, "devices": [{"top_kernels": [{"name": name, "total_ms": 1.0, "count": 2}]}]}
    result.write_text(json.dumps({"variants": [{"quantization": "none", "profile": profile},
                                               {"quantization": "int8+head", "profile": profile}]}))
    out = tmp_path / "rows.json"
    assert tool.main([str(hlo_file), "--profile", str(result), "--variant", "int8+head", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert list(rows) == ["int8+head"] and rows["int8+head"][0]["kernel"] == name
    assert name in capsys.readouterr().out
    assert tool.main([str(hlo_file)]) == 0 and "fused ops" in capsys.readouterr().out
    empty = tmp_path / "empty.txt"
    empty.write_text("HloModule m\n")
    assert tool.main([str(empty)]) == 2 and "no fusion instructions" in capsys.readouterr().err
    assert tool.main([str(hlo_file), "--profile", str(result), "--variant", "fp8"]) == 2
    assert "no profile of fp8" in capsys.readouterr().err


def test_cli_reads_a_kept_trace_directory(hlo, tmp_path, capsys):
    import gzip

    name = next(k for k, f in fusion_sources(hlo).items() if "pad" in f.op_names)
    hlo_file = tmp_path / "train.hlo.txt"
    hlo_file.write_text(hlo)
    meta = [{"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}}]
    kernels = [{"ph": "X", "pid": 2, "tid": 7, "ts": ts, "dur": 30, "name": kernel}
               for ts, kernel in ((0, name), (40, "sm90_xmma_gemm_bf16bf16"), (80, name), (120, name))]
    run = tmp_path / "trace" / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + kernels}, f)
    out = tmp_path / "rows.json"
    assert tool.main([str(hlo_file), "--trace", str(tmp_path / "trace"), "--steps", "2", "--out", str(out)]) == 0
    rows = {r["kernel"]: r for r in json.loads(out.read_text())["trace"]}
    assert rows[name]["per_step"] == 1.5 and rows[name]["ms_per_step"] == pytest.approx(0.045)
    assert "pad" in rows[name]["ops"]
    assert rows["sm90_xmma_gemm_bf16bf16"]["ops"] == []
    capsys.readouterr()
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": []}, f)
    assert tool.main([str(hlo_file), "--trace", str(tmp_path / "trace")]) == 2
    assert "no device kernels" in capsys.readouterr().err
