"""Hugging Face <-> mmjax conversion: logits parity with `transformers` (float32) in both directions.

Tiny random models; every direction goes through the CLI (`python -m mmjax.tools.convert_checkpoint`).
"""

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as T
from flax import nnx

from mmjax.checkpoint.convert import ConversionError, load_params
from mmjax.config import Config, from_tree
from mmjax.model import MLLM
from mmjax.model.decoder import Decoder
from mmjax.tools import convert_checkpoint as cli

IMG = 5
TOL = 1e-4
TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "mistral": (T.MistralConfig, T.MistralForCausalLM),
            "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM)}


def randomize(model, seed=0):
    """transformers inits some tensors to constants (norms, biases); make every one of them count."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(90)} | {"<unk>": 90}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "unk_token": "<unk>"}))


def run_cli(*args: str) -> None:
    assert cli.main([str(a) for a in args]) == 0


def mm_config(out: Path):
    params, meta, _ = load_params(out)
    return params, dataclasses.replace(from_tree(Config, meta["config"]).model, compute_dtype="float32"), meta


def load_loudly(cls, folder: Path):
    """from_pretrained, failing on any missing or unexpected tensor (a silently re-initialised weight)."""
    model, info = cls.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def decoder_logits(params, cfg, tokens):
    dec = nnx.eval_shape(lambda: Decoder(cfg, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    state = nnx.state(dec, nnx.Param)
    nnx.replace_by_pure_dict(state, params["decoder"])
    nnx.update(dec, state)
    b, s = tokens.shape
    pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    return np.asarray(dec(dec.embed(jnp.asarray(tokens)), jnp.asarray(pos), jnp.ones((b, s), jnp.int32)))


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # head_dim 8: one smoothed, three scaled frequencies


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "llama-rope-llama3"])
def test_decoder_parity_both_directions(family, tmp_path):
    extra = {"rope_scaling": LLAMA3_ROPE} if family.endswith("llama3") else {}
    family = family.split("-")[0]
    config_cls, model_cls = FAMILIES[family]
    hf = randomize(model_cls(config_cls(**TEXT, tie_word_embeddings=family == "qwen2", **extra)))
    hf.save_pretrained(tmp_path / "hf")
    write_tokenizer(tmp_path / "hf")
    tokens = np.random.default_rng(1).integers(0, TEXT["vocab_size"], (2, 16)).astype(np.int32)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()

    run_cli("import", tmp_path / "hf", tmp_path / "mm")
    params, cfg, meta = mm_config(tmp_path / "mm")
    assert cfg.text.qkv_bias == (family == "qwen2") and meta["towers"] == ["decoder"]
    assert cfg.text.rope_scaling == ("llama3" if extra else "none")
    assert (tmp_path / "mm" / "tokenizer" / "tokenizer.json").is_file()
    assert np.abs(decoder_logits(params, cfg, tokens) - ref).max() < TOL

    # export in small shards: index + several files, loaded lazily by transformers
    run_cli("export", tmp_path / "mm", tmp_path / "out", "--max-shard-gb", 20_000 / 2**30)
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    back = load_loudly(model_cls, tmp_path / "out")
    assert type(back.config).__name__ == config_cls.__name__
    with torch.no_grad():
        assert np.abs(back(torch.tensor(tokens, dtype=torch.long)).logits.numpy() - ref).max() < TOL
    original, exported = hf.state_dict(), back.state_dict()
    for name, value in original.items():
        assert torch.equal(value, exported[name]), name  # float32 both ways: bit-exact weights


def test_dtype_casting_and_inspect(tmp_path, capsys):
    hf = randomize(T.LlamaForCausalLM(T.LlamaConfig(**TEXT)))
    hf.save_pretrained(tmp_path / "hf")
    run_cli("import", tmp_path / "hf", tmp_path / "mm", "--dtype", "bfloat16")
    capsys.readouterr()
    run_cli("inspect", tmp_path / "mm")
    text = capsys.readouterr().out
    assert "decoder/layers/qkv" in text and "bfloat16" in text and "(2, 32, 2, 4, 8)" in text
    run_cli("export", tmp_path / "mm", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    back = load_loudly(T.LlamaForCausalLM, tmp_path / "out")
    assert back.model.embed_tokens.weight.dtype == torch.bfloat16
    want = hf.model.embed_tokens.weight.detach().to(torch.bfloat16)
    assert torch.equal(back.model.embed_tokens.weight, want)
    run_cli("export", tmp_path / "mm", tmp_path / "out32", "--dtype", "float32")
    assert load_loudly(T.LlamaForCausalLM, tmp_path / "out32").model.embed_tokens.weight.dtype == torch.float32


def llava(tower: str) -> "T.LlavaForConditionalGeneration":
    vision_kw = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=2,
                     image_size=8, patch_size=4)
    vision = T.CLIPVisionConfig(**vision_kw) if tower == "clip" else T.SiglipVisionConfig(**vision_kw)
    cfg = T.LlavaConfig(vision_config=vision, text_config=T.LlamaConfig(**TEXT), image_token_id=IMG,
                        image_seq_length=4, vision_feature_layer=-2 if tower == "clip" else -1,
                        vision_feature_select_strategy="default" if tower == "clip" else "full")
    return randomize(T.LlavaForConditionalGeneration(cfg))


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_llava_parity_both_directions(tower, tmp_path):
    hf = llava(tower)
    hf.save_pretrained(tmp_path / "hf")
    rng = np.random.default_rng(2)
    b, s = 2, 16
    tokens = rng.integers(6, TEXT["vocab_size"], (b, s)).astype(np.int32)
    tokens[0, 2:6] = IMG
    tokens[1, 9:13] = IMG
    pixels = rng.standard_normal((b, 3, 8, 8)).astype(np.float32)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(tokens, dtype=torch.long), pixel_values=torch.tensor(pixels)).logits.numpy()

    run_cli("import", tmp_path / "hf", tmp_path / "mm")
    params, cfg, meta = mm_config(tmp_path / "mm")
    assert meta["hf"]["image_token_id"] == IMG and cfg.image_attention == "causal"
    assert cfg.vision.n_layers == (2 if tower == "clip" else 3)  # CLIP: LLaVA reads layer -2; the last is unused
    model = nnx.eval_shape(lambda: MLLM(cfg, image_token_id=IMG, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    mm = model(jnp.asarray(tokens), jnp.asarray(np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))),
               jnp.ones((b, s), jnp.int32), jnp.asarray(pixels.transpose(0, 2, 3, 1)[:, None]), jnp.ones((b, 1), bool))
    assert np.abs(np.asarray(mm) - ref).max() < TOL

    run_cli("export", tmp_path / "mm", tmp_path / "out")
    back = load_loudly(T.LlavaForConditionalGeneration, tmp_path / "out")
    with torch.no_grad():
        out = back(input_ids=torch.tensor(tokens, dtype=torch.long), pixel_values=torch.tensor(pixels)).logits.numpy()
    assert np.abs(out - ref).max() < TOL


def test_unrepresentable_models_are_refused_in_one_line(tmp_path):
    cfg = T.LlamaConfig(**TEXT, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    randomize(T.LlamaForCausalLM(cfg)).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError, match="RoPE scaling") as e:
        from mmjax.checkpoint.convert import import_hf

        import_hf(tmp_path / "hf", tmp_path / "mm")
    assert "\n" not in str(e.value) and not (tmp_path / "mm").exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    assert cli.main(["import", str(tmp_path / "hf"), str(tmp_path / "busy")]) == 1
    assert (tmp_path / "busy" / "keep.txt").read_text() == "x"
