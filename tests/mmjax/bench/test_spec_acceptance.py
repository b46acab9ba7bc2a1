"""The real-weights speculation benchmark (`--mode spec-acceptance`) on a tiny chat model: a warm pass compiles
everything the timed one runs, speculation leaves greedy tokens unchanged, and the latest.json metrics come out."""

from mmjax.bench import spec as bench_spec
from mmjax.checkpoint.convert.init_from import converted_copy
from mmjax.data.tokenizer import Tokenizer
from mmjax.serving.load import load_for_serving


def test_warm_acceptance_run(hf_llama_dir, tmp_path):
    ckpt = converted_copy(hf_llama_dir, "float32", tmp_path)
    cfg, model, tok = load_for_serving(ckpt, Tokenizer.from_file(hf_llama_dir), overrides=["model.max_seq_len=1024"])
    r = bench_spec.run_acceptance(cfg, model, tok, num_tokens=2, new_tokens=6, methods=("none", "ngram_device"),
                                  rounds=2, warm=True)
    rows = {(x["method"], x["workload"]): x for x in r["rows"]}
    assert set(rows) == {(m, w) for m in ("none", "ngram_device") for w in bench_spec.WORKLOADS}
    for (method, _), x in rows.items():
        assert x["compiles_during_timing"] == 0, x
        assert x["same_as_plain"], x
        assert x["tokens"] > 0 and x["tok_s"] > 0
        if method == "none":
            assert x["speedup"] == 1.0 and x["drafted"] == 0
    latest = bench_spec.acceptance_latest(r, "x.json")
    assert set(latest) == {"ngram_speedup_bs1_repetitive"}
    assert latest["ngram_speedup_bs1_repetitive"]["value"] == round(rows["ngram_device", "repeat_edit"]["speedup"], 3)
    assert "| ngram_device | repeat_edit |" in bench_spec.acceptance_table(r)
