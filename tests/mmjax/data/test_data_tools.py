"""mmjax.tools.prepare_data (bad records reported, not fatal) and the bench library, run in-process."""

import json

from mmjax.tools.prepare_data import main


def test_prepare_data_cli_reports_bad_records(llava_export, tmp_path, capsys):
    lines = (llava_export / "train.jsonl").read_text().splitlines()[:20]
    recs = [json.loads(x) for x in lines]
    for r in recs:
        r["image"] = str(llava_export / r["image"])
    (tmp_path / "bad.png").write_bytes(b"garbage")
    rows = [json.dumps(r) for r in recs] + ['{"id": "cut-off", "conver',
                                            json.dumps(dict(recs[0], id="x9", image=str(tmp_path / "bad.png")))]
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")
    rc = main(["--format", "llava", "--input", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out"),
               "--records-per-shard", "8", "--cache-dir", str(tmp_path / "cache")])
    out, err = capsys.readouterr()
    assert rc == 0 and json.loads(out[out.index("{"):])["num_records"] == 20
    assert "not valid JSON" in err and "record x9: image bytes cannot be decoded" in err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["bad_records"] == 2 and [s["records"] for s in manifest["shards"]] == [7, 7, 6]
    assert main(["--format", "llava", "--input", str(tmp_path / "none*.jsonl"), "--out", str(tmp_path / "o2")]) == 1


def test_bench_library_smoke(cfg, tmp_path):
    import dataclasses

    from mmjax.bench.data import llava_like_config, make_llava_like, measure
    from mmjax.data.tokenizer import Tokenizer

    root = make_llava_like(tmp_path / "ll", num_records=16, num_shards=2)
    bcfg = llava_like_config(cfg, root)
    bcfg = dataclasses.replace(bcfg, model=dataclasses.replace(bcfg.model, max_seq_len=1024),
                               data=dataclasses.replace(bcfg.data, packing=True, max_images=2))
    row = measure(bcfg, Tokenizer.from_file(root), workers=0, seconds=0.2, warmup=1)
    assert row["samples_per_sec"] > 0 and row["tokens_per_sec"] > 0 and 0 <= row["padding_share"] < 1
    assert row["sequences_per_row"] >= 1
