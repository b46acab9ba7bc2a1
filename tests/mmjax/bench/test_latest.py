"""docs/perf/latest.json and the README generated from it: merging one benchmark's section keeps the rest,
rendering depends on the file alone, and the committed README is exactly the rendering of the committed file
(so the two cannot drift), with no number that latest.json does not hold."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mmjax.bench import latest as L

ROOT = Path(__file__).resolve().parents[3]
LATEST = ROOT / "docs" / "perf" / "latest.json"
README = ROOT / "docs" / "perf" / "README.md"
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


@pytest.fixture
def seeded(tmp_path):
    """A latest.json with two sections, written the way a benchmark would."""
    path = tmp_path / "perf" / "latest.json"
    L.update_latest("serving", {"hbm_gbps": 2941, "default_decode": {"bs1": {"tok_s": 300}, "bs32": {"tok_s": 7000}},
                                "server": {"slo_rate_req_s": {"value": None, "note": "not measured yet"}}},
                    device="H100", command="bench_serving v1", commit="aaaaaaa", path=path, date="2026-12-01")
    L.update_latest("train", {"text_tok_s": {"value": 60000, "label": "decoder", "headline": True,
                                             "target": {"op": ">=", "value": 70000}}},
                    device="H200", command="bench_train", commit="bbbbbbb", path=path, date="2026-12-02")
    return path


def test_update_merges_one_section_and_keeps_the_rest(seeded):
    before = json.loads(seeded.read_text())
    after = L.update_latest("serving", {"default_decode": {"bs1": {"tok_s": 680}},
                                        "server": {"slo_rate_req_s": 26}},
                            device="H100 #2", command="bench_serving v2", commit="ccccccc", path=seeded,
                            date="2026-12-06")
    assert after == json.loads(seeded.read_text())
    assert after["train"] == before["train"]
    serving = after["serving"]
    assert {k: serving[k] for k in ("device", "date", "commit", "command")} == {
        "device": "H100 #2", "date": "2026-12-06", "commit": "ccccccc", "command": "bench_serving v2"}
    assert serving["default_decode"]["bs1"]["tok_s"] == {"value": 680, "date": "2026-12-06"}
    # Not re-measured: the old value, date, device, commit and command stay attached to it.
    assert serving["default_decode"]["bs32"]["tok_s"] == {
        "value": 7000, "date": "2026-12-01", "device": "H100", "commit": "aaaaaaa", "command": "bench_serving v1"}
    assert serving["hbm_gbps"]["value"] == 2941 and serving["hbm_gbps"]["command"] == "bench_serving v1"
    # Measured now: the stale note goes, the date comes.
    assert serving["server"]["slo_rate_req_s"] == {"value": 26, "date": "2026-12-06"}


def test_update_keeps_a_metrics_description_and_adds_new_sections(seeded):
    after = L.update_latest("train", {"text_tok_s": 62000, "mllm_mfu": 0.47}, device="H200", command="bench_train",
                            commit="bbbbbbb", path=seeded, date="2026-12-03")
    assert after["train"]["text_tok_s"] == {"label": "decoder", "headline": True, "value": 62000,
                                            "date": "2026-12-03", "target": {"op": ">=", "value": 70000}}
    assert after["train"]["mllm_mfu"] == {"value": 0.47, "date": "2026-12-03"}
    after = L.update_latest("checkpoint", {"restore_s": 7.5}, device="H200", command="bench_checkpoint",
                            commit="ddddddd", path=seeded, date="2026-12-04")
    assert list(after) == ["serving", "train", "checkpoint"]
    assert after["serving"] == json.loads(json.dumps(after["serving"]))  # untouched, still plain JSON


def test_update_writes_the_readme_beside_it_and_leaves_no_temporary_files(seeded):
    assert (seeded.parent / "README.md").read_text() == L.render_readme(L.load_latest(seeded))
    assert sorted(p.name for p in seeded.parent.iterdir()) == ["README.md", "latest.json"]


@pytest.mark.parametrize("values, message", [
    ({"tok_s": "fast"}, "serving.tok_s: value must be a finite number or null"),
    ({"tok_s": float("nan")}, "serving.tok_s: value must be a finite number"),
    ({"tok_s": True}, "serving.tok_s: value must be a finite number"),
    ({"default_decode": 5}, "serving.default_decode: is a group in latest.json"),
    ({"hbm_gbps": {"bs1": 3}}, "serving.hbm_gbps: is a metric in latest.json"),
    ({"tok_s": {"value": 1, "unt": "x"}}, "serving.tok_s: unknown metric field(s) ['unt']"),
    ({"tok_s": {"value": 1, "target": {"op": ">", "value": 2}}}, "serving.tok_s: target must be"),
    ({"date": 3}, "serving.date: metric names must be"),
    ({}, "serving: values must be a non-empty dict"),
])
def test_update_refuses_bad_values_and_writes_nothing(seeded, values, message):
    before = seeded.read_text()
    with pytest.raises(ValueError) as e:
        L.update_latest("serving", values, device="H100", command="c", path=seeded)
    assert message in str(e.value)
    assert seeded.read_text() == before


def test_render_is_deterministic():
    latest = L.load_latest(LATEST)
    first = L.render_readme(latest)
    assert L.render_readme(json.loads(json.dumps(latest))) == first
    assert L.render_readme(copy.deepcopy(latest)) == first
    assert latest == L.load_latest(LATEST)  # rendering does not change its input


def test_committed_readme_is_the_rendering_of_latest_json():
    assert README.read_text() == L.render_readme(L.load_latest(LATEST)), \
        "docs/perf/README.md is stale: run `python -m mmjax.bench.latest`"
    # The command the docs name agrees, and the module imports without jax (it must run on any machine).
    check = subprocess.run([sys.executable, "-m", "mmjax.bench.latest", "--check"], cwd=ROOT,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    bare = subprocess.run([sys.executable, "-c", "import sys, mmjax.bench.latest; assert 'jax' not in sys.modules"],
                          cwd=ROOT, capture_output=True, text=True)
    assert bare.returncode == 0, bare.stderr


def test_check_fails_on_a_stale_readme(tmp_path, capsys):
    (tmp_path / "latest.json").write_text(LATEST.read_text())
    (tmp_path / "README.md").write_text(README.read_text().replace("62,047", "62,048"))
    assert L.main(["--latest", str(tmp_path / "latest.json"), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert L.main(["--latest", str(tmp_path / "latest.json")]) == 0
    assert L.main(["--latest", str(tmp_path / "latest.json"), "--check"]) == 0


def test_every_number_in_the_readme_is_in_latest_json():
    latest = L.load_latest(LATEST)
    known = set(NUMBER.findall(json.dumps(latest, ensure_ascii=False)))
    for section in latest.values():
        for key, metric in L.metrics(section):
            unit = L.unit_of(key, metric)
            known |= set(NUMBER.findall(L.format_value(metric["value"], unit)))
            known |= set(NUMBER.findall(L.format_target(metric, unit)))
    text = README.read_text()
    assert sorted(set(NUMBER.findall(text)) - known) == []
    assert len(text.splitlines()) <= 150


def test_latest_json_has_the_sections_and_keys_the_perf_page_promises():
    latest = L.load_latest(LATEST)
    required = {
        "train": ["text_tok_s", "peer_tok_s", "ratio_vs_peer", "text_mfu", "mllm_tok_s", "mllm_mfu",
                  "mllm_compile_s", "fp8_vs_bf16"],
        "serving": ["hbm_gbps"] + [f"default_decode.bs{b}.{k}" for b in (1, 32, 64)
                                   for k in ("tok_s", "fraction_of_roofline")]
                   + [f"server.{k}" for k in ("saturation_output_tok_s", "offline_mixed_output_tok_s",
                                              "server_vs_offline", "slo_rate_req_s", "mm_saturation_output_tok_s")],
        "spec": ["ngram_speedup_bs1_repetitive", "draft_speedup_bs1_repetitive", "worst_speedup"],
        "quant": ["int8_speedup_bs1", "fp8_speedup_bs1", "int8_fraction_of_roofline_bs1"],
        "kernels": [], "data": [], "checkpoint": [],
    }
    for section, keys in required.items():
        fields = latest[section]
        assert all(f in fields for f in ("device", "date", "commit", "command")), section
        found = dict(L.metrics(fields))
        assert found, section
        assert set(keys) <= set(found), (section, set(keys) - set(found))
        for key, metric in found.items():
            L._check_metric(f"{section}.{key}", metric)
            if metric["value"] is None:
                assert metric.get("note"), f"{section}.{key}: a number not measured says why"
            else:
                assert re.fullmatch(r"\d{4}-\d\d-\d\d", metric["date"]), f"{section}.{key}: date measured"
            if L.unit_of(key, metric) == "fraction" and metric["value"] is not None:
                assert 0 <= metric["value"] <= 1, f"{section}.{key}: fractions are 0..1"


@pytest.mark.parametrize("section, module, result", [
    ("kernels", "mmjax.bench.kernels", "kernels/kernels-2026-12-04b.json"),
    ("serving", "mmjax.bench.serving", "serving/serving-h100-2026-12-05.json"),
    ("quant", "mmjax.bench.quant", "quant/serving-quant-final-h100-2026-12-06.json"),
])
def test_benchmark_values_fit_latest_json(tmp_path, section, module, result):
    """Each benchmark's `latest_values`, taken from one of its real result files, merges into a copy of the
    committed latest.json onto metrics that exist there (a renamed key would add a stray row instead)."""
    import importlib

    record = json.loads((ROOT / "docs" / "perf" / "results" / result).read_text())
    values = importlib.import_module(module).latest_values(record, source=result)
    assert values
    path = tmp_path / "latest.json"
    path.write_text(LATEST.read_text())
    before = dict(L.metrics(json.loads(LATEST.read_text())[section]))
    after = L.update_latest(section, values, device="dev", command="cmd", path=path, readme=None)
    changed = {k: m for k, m in L.metrics(after[section]) if m.get("source") == result}
    assert changed and set(changed) <= set(before), sorted(set(changed) - set(before))
