"""`model.init_from=hf:PATH`: one-step training from a Hugging Face folder (tiny random Llama-3-style model)."""

import json
import shutil

import jax
import numpy as np
import torch

from mmjax.checkpoint.convert.init_from import load_run_config
from mmjax.train import main
from mmjax.training.trainer import Trainer

RECORDS = [{"id": str(i), "conversations": [{"from": "human", "value": "Hello there, how are you today?"},
                                           {"from": "gpt", "value": f"It is red {i}."}]} for i in range(16)]


def overrides(hf_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    return [f"model.init_from=hf:{hf_dir}", f"data.paths=[{data}]", f"data.cache_dir={tmp_path / 'cache'}",
            f"train.output_dir={tmp_path / 'run'}", "model.max_seq_len=128", "model.compute_dtype=float32",
            "model.remat=none", "data.packing=false", "data.num_workers=0", "train.global_batch_size=8",
            "train.steps=2", "optim.warmup_steps=0", "optim.lr=1e-3", "observe.sinks=[jsonl]", "observe.log_every=1",
            "checkpoint.enabled=false"]


def test_init_from_hf_trains_from_the_exact_weights(hf_llama_dir, tmp_path):
    from transformers import LlamaForCausalLM

    cfg = load_run_config("finetune_llava.yaml", [*overrides(hf_llama_dir, tmp_path)[:-1], "checkpoint.every_steps=0",
                                                  "checkpoint.async=false"])
    assert cfg.model.text_only and cfg.model.text.dim == 32 and cfg.data.tokenizer == str(hf_llama_dir)
    trainer = Trainer(cfg)
    params = jax.device_get(trainer.state.params)
    model = jax.tree.map(np.asarray, params)
    from mmjax.serving.load import build_model

    mm = build_model(cfg, model, image_token_id=0)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 12)).astype(np.int32)
    pos = np.broadcast_to(np.arange(12, dtype=np.int32), (2, 12))
    ours = np.asarray(mm(tokens, pos, np.ones((2, 12), np.int32)))
    hf = LlamaForCausalLM.from_pretrained(hf_llama_dir).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(ours - ref).max() < 1e-4
    trainer.run()
    losses = [json.loads(x)["train/loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "train/loss" in x]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert len(list((tmp_path / "cache" / "hf_import").iterdir())) == 1  # the converted copy, reused next time
    # export back: the family and tokenizer come from the folder the run started from
    from mmjax.checkpoint.convert import export_hf

    export_hf(tmp_path / "run" / "checkpoints", tmp_path / "out")
    back, info = LlamaForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and (tmp_path / "out" / "tokenizer_config.json").is_file()
    # the source's context length and token ids, not the fine-tune's model.max_seq_len=128 or nothing
    source, exported = (json.loads((d / "config.json").read_text()) for d in (hf_llama_dir, tmp_path / "out"))
    assert cfg.model.max_seq_len == 128 < source["max_position_embeddings"]
    for key in ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert exported.get(key) == source.get(key), key
    with torch.no_grad():
        moved = back.eval()(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert 0 < np.abs(moved - ref).max()  # trained: the weights moved


def test_bad_folders_are_one_line_errors(hf_llama_dir, tmp_path, capsys):
    def run(folder, *extra):
        code = main(["--config", "finetune_llava.yaml", *overrides(folder, tmp_path), *extra])
        err = capsys.readouterr().err.strip()
        assert code != 0 and "\n" not in err, err
        return err

    (tmp_path / "empty").mkdir()
    assert "has no config.json" in run(tmp_path / "empty")
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(hf_llama_dir, gpt2)
    (gpt2 / "config.json").write_text(json.dumps({**json.loads((gpt2 / "config.json").read_text()),
                                                  "model_type": "gpt2"}))
    assert "model_type='gpt2' is not supported" in run(gpt2)
    assert "model.text.dim=64 conflicts" in run(hf_llama_dir, "model.text.dim=64")
    wrong = tmp_path / "wrong"
    shutil.copytree(hf_llama_dir, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 64}))
    err = run(wrong)
    assert err.startswith("error:") and "expected shape" in err


def test_llava_folder_gives_the_multimodal_model_its_template_and_image_token(chat_tokenizer_dirs, tmp_path):
    import transformers as T

    from mmjax.data.tokenizer import Tokenizer

    folder = tmp_path / "llava"
    shutil.copytree(chat_tokenizer_dirs["llava"], folder)
    vocab = Tokenizer.from_file(folder).vocab_size
    vision = T.CLIPVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=2,
                                image_size=8, patch_size=4)
    text = T.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    T.LlavaConfig(vision_config=vision, text_config=text, image_token_id=3, image_seq_length=4).save_pretrained(folder)
    cfg = load_run_config("finetune_llava.yaml", overrides(folder, tmp_path) + ["model.image_attention=causal"])
    m = cfg.model
    assert not m.text_only and m.image_attention == "causal" and m.vision.n_layers == 2 and m.image_tokens == 4
    tok = Tokenizer.from_file(cfg.data.tokenizer)
    assert tok.image_id == 3 and tok.chat_template.startswith("{% for message in messages %}")
    record = [{"from": "human", "value": "<image>\nWhat color?"}, {"from": "gpt", "value": "red"}]
    ids, mask = tok.encode_chat(record, m.image_tokens)
    assert ids.count(3) == 4 and tok.decode([i for i, k in zip(ids, mask) if k]) == "red "  # the answer and a space
