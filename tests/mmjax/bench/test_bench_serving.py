"""The serving benchmark on a tiny text-only decoder on the CPU: every field present and positive, the roofline
from a hand-counted byte total, no compile while timing, the JSON and the README section written."""

import dataclasses
import json

import pytest

from mmjax.bench import serving as bench
from mmjax.config import Config, ModelConfig, ServeConfig, TextConfig


def tiny_cfg() -> Config:
    model = ModelConfig(vocab_size=64, max_seq_len=64, compute_dtype="float32", param_dtype="float32",
                        text_only=True, text=TextConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=48))
    serve = ServeConfig(page_size=4, num_pages=8, max_num_batched_tokens=32, max_num_seqs=2, min_token_bucket=8)
    return dataclasses.replace(Config(), model=model, serve=serve)


SPEC = bench.BenchSpec(batches=(1, 4), prompt_len=12, new_tokens=6, ttft_prompts=(16, 40), ttft_repeats=2,
                       num_requests=10, hbm_gbps=100.0,
                       lengths=bench.LengthDistribution(prompt_mu=2.5, prompt_sigma=0.5, output_mu=1.8,
                                                        output_sigma=0.4, min_len=2, max_prompt=30, max_output=10,
                                                        max_total=40))


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    return bench.run_serving_bench(tiny_cfg(), SPEC)


def test_sizes_raised_to_the_spec():
    cfg = bench.serving_config(tiny_cfg(), SPEC)
    assert cfg.serve.max_num_seqs == 4 and cfg.serve.max_model_len == 41 and cfg.model.max_seq_len == 64
    assert cfg.serve.num_pages == 1 + 4 * 11  # 4 requests of 41 tokens in pages of 4
    assert cfg.serve.max_num_batched_tokens == 32 and cfg.serve.page_size == 4


def test_lengths_follow_the_filter():
    import numpy as np
    d = SPEC.lengths
    lengths = d.sample(500, np.random.default_rng(0))
    assert all(d.min_len <= p <= d.max_prompt and d.min_len <= o <= d.max_output and p + o <= d.max_total
               for p, o in lengths)
    assert lengths == d.sample(500, np.random.default_rng(0))  # a fixed seed gives the same workload


def test_record(record, tmp_path):
    d, h, kv, layers, ffn, vocab = 32, 8, 2, 2, 48, 64
    per_layer = d * (4 + 2 * kv) * h + 4 * h * d + 3 * d * ffn + 2 * d  # qkv, out, gate/up/down, two norms
    weight_bytes = 4 * (vocab * d + d + layers * per_layer)  # tied embedding, final norm; float32
    kv_per_token = layers * 2 * kv * h * 4
    assert record["model"]["weight_bytes"] == weight_bytes
    assert record["model"]["kv_bytes_per_token"] == kv_per_token

    assert [r["batch"] for r in record["decode"]] == [1, 4]
    for r in record["decode"]:
        assert r["compiles_during_timing"] == 0
        assert r["gc_full_collections"] >= 0 and len(r["gc_ms"]) == 3 and min(r["gc_ms"]) >= 0
        # the decode window: every request decodes in each of new_tokens calls (one token per call on the CPU),
        # after the prefill (batch 4: two calls of the 32-token budget, the first two requests decoding in the
        # second) and two untimed calls
        assert r["decode_steps"] == SPEC.new_tokens and r["decode_tokens"] == SPEC.new_tokens * r["batch"]
        for key in ("decode_tok_s", "decode_step_ms", "e2e_tok_s", "e2e_s"):
            assert r[key] > 0, key
        # prompt 12; before the timed calls a request has 3 tokens (batch 4: 3 or 4, one prefilled a call later),
        # and a call that makes token j + 1 attends over 12 + j
        context = r["roofline"]["mean_context"]
        assert context == pytest.approx(12 + (5.5 if r["batch"] == 1 else 6.0)), context
        step_bytes = weight_bytes + r["batch"] * context * kv_per_token
        roofline = r["batch"] * 100e9 / step_bytes
        assert r["roofline"]["step_bytes"] == pytest.approx(step_bytes)
        assert r["roofline"]["tok_s"] == pytest.approx(roofline)
        assert r["fraction_of_roofline"] == pytest.approx(r["decode_tok_s"] / roofline)

    assert [t["prompt_len"] for t in record["ttft"]] == [16, 40]
    for t in record["ttft"]:
        assert t["compiles_during_timing"] == 0 and len(t["ttft_s"]) == 2
        assert t["ttft_median_s"] > 0 and all(x > 0 for x in t["ttft_s"])

    x = record["mixed"]
    assert x["num_requests"] == 10 and x["compiles_during_timing"] == 0
    for key in ("total_s", "output_tok_s", "total_tok_s", "requests_s", "mean_prompt_len", "mean_output_len"):
        assert x[key] > 0, key
    for key in ("ttft_s", "tpot_s"):
        s = x[key]
        assert 0 < s["p50"] <= s["p90"] and s["mean"] > 0, key
    assert x["total_tok_s"] > x["output_tok_s"]
    assert record["hf"] == {"skipped": "no Hugging Face config given"}
    for key in ("date", "device", "platform", "versions", "serve", "spec", "engine_stats"):
        assert record[key], key

    out = tmp_path / "serving.json"
    out.write_text(json.dumps(record))
    assert json.loads(out.read_text())["decode"][0]["batch"] == 1
    text = bench.table(record)
    assert "| 4 |" in text and "HF peer skipped" in text and "Mixed: 10 requests" in text
    values = bench.latest_values(record, source="serving.json")  # latest.json's serving rows
    group = "default_decode" if record["serve"]["decode_steps"] == ServeConfig().decode_steps else "tuned_decode"
    assert set(values) == {"hbm_gbps", group}
    assert sorted(values[group]) == sorted(f"bs{d['batch']}" for d in record["decode"])
    first = round(record["decode"][0]["decode_tok_s"])
    assert values[group]["bs1"]["tok_s"] == {"value": first, "source": "serving.json"}


def test_hf_peer_in_its_own_process():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from mmjax.checkpoint.convert.hf import text_config_to_hf
    m = tiny_cfg().model
    hf = text_config_to_hf(m.text, m.vocab_size, m.max_seq_len, "llama", "float32")
    spec = bench.BenchSpec(batches=(1, 3), prompt_len=8, new_tokens=5)
    r = bench.hf_peer(hf, spec, dtype="float32", allow_cpu=True)
    assert [row["batch"] for row in r["rows"]] == [1, 3], r
    for row in r["rows"]:  # one timing each: no ordering between them is asserted (a loaded machine reorders)
        assert row["e2e_tok_s"] > 0 and row["prefill_s"] > 0 and row["e2e_s"] > 0
        assert row["decode_tok_s"] is None or row["decode_tok_s"] > 0
    import torch
    if not torch.cuda.is_available():  # without --hf-on-cpu a CPU-only torch is a skip with the reason
        assert "no CUDA" in bench.hf_peer(hf, spec, dtype="float32")["skipped"]


def test_build_model_takes_params():
    import jax
    import numpy as np
    from flax import nnx
    first = bench.build_model(tiny_cfg())
    doubled = jax.tree.map(lambda x: np.asarray(x) * 2, nnx.to_pure_dict(nnx.state(first, nnx.Param)))
    second = bench.build_model(tiny_cfg(), doubled)
    for a, b in zip(jax.tree.leaves(nnx.state(first, nnx.Param)), jax.tree.leaves(nnx.state(second, nnx.Param))):
        np.testing.assert_allclose(np.asarray(b), 2 * np.asarray(a))
