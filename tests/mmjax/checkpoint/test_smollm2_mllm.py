"""An MLLM on SmolLM2-135M-Instruct's decoder (`finetune_smollm2_mllm.yaml`): the text model's folder gets an image
token and a grown embedding, the run trains on images, and before training the original vocabulary's logits of
text are `transformers`' own. The grown folder and its converted weights go to the user's cache (keyed by the
source folder's files), so only a machine's first run writes them."""

import io
import json

import jax
import numpy as np
import pytest
import torch
import transformers as T
from PIL import Image

from mmjax.checkpoint.convert.image_token import IMAGE_TOKEN, VOCAB_MULTIPLE
from mmjax.checkpoint.convert.init_from import load_run_config
from mmjax.checkpoint.known_models import cache_root
from mmjax.data.tokenizer import Tokenizer
from mmjax.serving.load import build_model
from mmjax.training.trainer import Trainer

pytestmark = pytest.mark.real_model

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 20)}


def _llava_records(root):
    records = []
    for name, rgb in COLOURS.items():
        buf = io.BytesIO()
        Image.new("RGB", (32, 32), rgb).save(buf, format="PNG")
        (root / f"{name}.png").write_bytes(buf.getvalue())
        records.append({"id": name, "image": f"{name}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat colour is this square?"},
            {"from": "gpt", "value": f"It is {name}."}]})
    (root / "train.json").write_text(json.dumps(records))
    return root / "train.json"


def test_mllm_on_smollm2_adds_the_image_token_keeps_text_logits_and_trains(smollm2, tmp_path):
    data = _llava_records(tmp_path)
    cfg = load_run_config("finetune_smollm2_mllm.yaml", [
        f"model.init_from=hf:{smollm2}", f"data.paths=[{data}]", f"data.cache_dir={cache_root() / 'test_cache'}",
        f"train.output_dir={tmp_path / 'run'}", "model.max_seq_len=64", "model.compute_dtype=float32",
        "model.remat=none", "model.vision.image_size=32", "model.vision.dim=64", "model.vision.n_layers=1",
        "model.vision.n_heads=2", "model.vision.mlp_dim=128", "data.packing=false", "data.num_workers=0",
        "train.global_batch_size=2", "train.steps=2", "optim.warmup_steps=0", "observe.sinks=[jsonl]",
        "observe.log_every=1", "checkpoint.enabled=false"])
    vocab = json.loads((smollm2 / "config.json").read_text())["vocab_size"]
    tok = Tokenizer.from_file(cfg.data.tokenizer)
    assert "image_token" in cfg.model.init_from and not cfg.model.text_only
    assert tok.image_id == vocab and tok.vocab_size == vocab + 1
    assert cfg.model.vocab_size == -(-(vocab + 1) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    ids, _ = tok.encode_chat([{"from": "human", "value": f"{IMAGE_TOKEN}\nHi"}, {"from": "gpt", "value": "Hello"}],
                             image_tokens=cfg.model.image_tokens)
    assert ids.count(vocab) == cfg.model.image_tokens == 4  # each marker becomes the model's image tokens

    trainer = Trainer(cfg, devices=jax.devices()[:1])
    params = jax.tree.map(np.asarray, jax.device_get(trainer.state.params))
    table = params["decoder"]["embedding"]
    np.testing.assert_allclose(table[vocab:], np.broadcast_to(table[:vocab].mean(0), table[vocab:].shape),
                               rtol=1e-5, atol=1e-6)  # the new rows are the mean embedding
    tokens = np.asarray([tok.encode("The capital of Italy is Rome, and of France")], np.int32)
    pos = np.arange(tokens.shape[1], dtype=np.int32)[None]
    v = cfg.model.vision
    no_image = np.zeros((1, 1, v.image_size, v.image_size, v.channels), np.float32), np.zeros((1, 1), bool)
    ours = np.asarray(build_model(cfg, params, image_token_id=tok.image_id)(tokens, pos, np.ones_like(tokens),
                                                                             *no_image))
    with torch.no_grad():
        theirs = T.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()(
            torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert ours.shape[-1] == cfg.model.vocab_size
    np.testing.assert_allclose(ours[..., :vocab], theirs, atol=2e-3)

    trainer.run()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(x)["train/loss"] for x in lines if "train/loss" in x]
    assert len(losses) == 2 and np.isfinite(losses).all()


def test_shapes_recipe_config_takes_the_real_decoder(smollm2, tmp_path):
    """`smollm2_shapes.yaml` (the recipe on the built-in data) resolves to SmolLM2's decoder with the image token added,
    the new small tower in front and the built-in shapes data."""
    cfg = load_run_config("smollm2_shapes.yaml", [f"model.init_from=hf:{smollm2}",
                                                  f"data.cache_dir={cache_root() / 'test_cache'}"])
    vocab = json.loads((smollm2 / "config.json").read_text())["vocab_size"]
    assert cfg.data.dataset == "shapes" and not cfg.model.text_only and cfg.model.image_tokens == 9
    assert cfg.model.text.n_layers == 30 and cfg.model.vocab_size == -(-(vocab + 1) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    assert Tokenizer.from_file(cfg.data.tokenizer).image_id == vocab
