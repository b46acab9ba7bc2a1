"""Hugging Face <-> mmjax: config translation and one table of tensor rules per model part.

A `Rule` ties one mmjax parameter (a path in the params dict; under `layers` it is stacked on a leading
layer axis) to the Hugging Face tensors it is made of, with the two reshapes between them. Import and
export walk the same table, so the two directions cannot drift apart.

Supported: decoders `llama`, `mistral`, `qwen2` (q/k/v biases -> `model.text.qkv_bias`), and `llava`
with a `clip_vision_model` or `siglip_vision_model` tower (single feature layer, "default" selection).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from mmjax.config import ModelConfig, ProjectorConfig, TextConfig, VisionConfig
from mmjax.errors import CheckpointError

DECODER_FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
VISION_FAMILIES = ("clip_vision_model", "siglip_vision_model")
HF_ACT = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ConversionError(CheckpointError):
    """A Hugging Face model or an mmjax checkpoint that the other side cannot represent exactly."""


@dataclasses.dataclass(frozen=True)
class Rule:
    mm: str  # "decoder/layers/qkv"
    hf: tuple[str, ...]  # Hugging Face names; "{i}" = layer index for layered rules
    load: Callable[..., np.ndarray]  # hf arrays -> mmjax array (one layer for layered rules)
    save: Callable[[np.ndarray], tuple[np.ndarray, ...]]  # the inverse
    layered: bool = False


def _t(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.T)


def _same(x: np.ndarray) -> np.ndarray:
    return x


# ------------------------------------------------------------------------------------------------
# Decoder (Llama / Mistral / Qwen2 share the layout; Qwen2 adds q/k/v biases)


def decoder_rules(t: TextConfig, prefix: str, lm_head: str) -> list[Rule]:
    """`prefix` is where the Hugging Face decoder lives ("model." in *ForCausalLM)."""
    kv, d, e = t.n_kv_heads, t.resolved_head_dim, t.dim
    g = t.n_heads // kv
    L = f"{prefix}layers.{{i}}."

    def qkv_load(q, k, v):  # [H*D, E], [KV*D, E] x2 -> [E, KV, G+2, D]
        q = q.reshape(kv, g, d, e)
        return np.concatenate([q, k.reshape(kv, 1, d, e), v.reshape(kv, 1, d, e)], axis=1).transpose(3, 0, 1, 2)

    def qkv_save(w):  # [E, KV, G+2, D]
        w = w.transpose(1, 2, 3, 0)  # [KV, G+2, D, E]
        return (w[:, :g].reshape(kv * g * d, e), w[:, g].reshape(kv * d, e), w[:, g + 1].reshape(kv * d, e))

    def bias_load(q, k, v):
        return np.concatenate([q.reshape(kv, g, d), k.reshape(kv, 1, d), v.reshape(kv, 1, d)], axis=1)

    def bias_save(b):
        return b[:, :g].reshape(-1), b[:, g].reshape(-1), b[:, g + 1].reshape(-1)

    rules = [
        Rule("decoder/embedding", (f"{prefix}embed_tokens.weight",), _same, lambda x: (x,)),
        Rule("decoder/final_norm/scale", (f"{prefix}norm.weight",), _same, lambda x: (x,)),
        Rule("decoder/layers/attn_norm/scale", (L + "input_layernorm.weight",), _same, lambda x: (x,), True),
        Rule("decoder/layers/qkv", tuple(L + f"self_attn.{p}_proj.weight" for p in "qkv"), qkv_load, qkv_save, True),
        Rule("decoder/layers/out", (L + "self_attn.o_proj.weight",),
             lambda w: w.reshape(e, t.n_heads, d).transpose(1, 2, 0),
             lambda w: (w.transpose(2, 0, 1).reshape(e, t.n_heads * d),), True),
        Rule("decoder/layers/mlp_norm/scale", (L + "post_attention_layernorm.weight",), _same, lambda x: (x,), True),
        Rule("decoder/layers/gate_up", (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"),
             lambda gate, up: np.stack([gate.T, up.T], axis=1), lambda w: (_t(w[:, 0]), _t(w[:, 1])), True),
        Rule("decoder/layers/down", (L + "mlp.down_proj.weight",), _t, lambda w: (_t(w),), True),
    ]
    if t.qkv_bias:
        rules.append(Rule("decoder/layers/qkv_bias", tuple(L + f"self_attn.{p}_proj.bias" for p in "qkv"),
                          bias_load, bias_save, True))
    if not t.tie_embeddings:
        rules.append(Rule("decoder/lm_head", (lm_head,), _t, lambda w: (_t(w),)))
    return rules


def text_config_from_hf(hf: dict[str, Any]) -> TextConfig:
    family = hf.get("model_type")
    if family not in DECODER_FAMILIES:
        raise ConversionError(f"decoder model_type={family!r} is not supported; "
                              f"supported: {', '.join(DECODER_FAMILIES)}")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    params = {**scaling, **rope}
    if rope_type not in (None, "default", "llama3"):
        raise ConversionError(f"rope_type={rope_type!r} (RoPE scaling) is not implemented in mmjax's decoder; "
                              "only unscaled and llama3-scaled RoPE convert exactly")
    llama3 = {}
    if rope_type == "llama3":
        llama3 = dict(rope_scaling="llama3", rope_factor=float(params["factor"]),
                      rope_low_freq_factor=float(params["low_freq_factor"]),
                      rope_high_freq_factor=float(params["high_freq_factor"]),
                      rope_original_max_len=int(params["original_max_position_embeddings"]))
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConversionError(f"{family}: attention_bias/mlp_bias=true has no mmjax equivalent (only Qwen2-style "
                              "q/k/v biases are supported)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"{family}: hidden_act={hf['hidden_act']!r}; mmjax's decoder MLP is SwiGLU (silu)")
    if family == "qwen2" and hf.get("use_sliding_window"):
        raise ConversionError("qwen2: use_sliding_window=true is not supported (mmjax attends to the full context)")
    n_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    return TextConfig(
        dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=0 if head_dim * n_heads == hf["hidden_size"] else head_dim,
        mlp_dim=hf["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2",
        **llama3,
    )


def text_config_to_hf(t: TextConfig, vocab_size: int, max_len: int, family: str, dtype: str) -> dict[str, Any]:
    if family not in DECODER_FAMILIES:
        raise ConversionError(f"--family {family!r} is not one of {', '.join(DECODER_FAMILIES)}")
    if t.qkv_bias != (family == "qwen2"):
        need = "qwen2" if t.qkv_bias else "llama or mistral"
        raise ConversionError(f"model.text.qkv_bias={t.qkv_bias} exports only as {need}, not {family}")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": t.rope_theta}
    if t.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=t.rope_factor, low_freq_factor=t.rope_low_freq_factor,
                    high_freq_factor=t.rope_high_freq_factor, original_max_position_embeddings=t.rope_original_max_len)
    out = {
        "architectures": [DECODER_FAMILIES[family]], "model_type": family, "vocab_size": vocab_size,
        "hidden_size": t.dim, "intermediate_size": t.mlp_dim, "num_hidden_layers": t.n_layers,
        "num_attention_heads": t.n_heads, "num_key_value_heads": t.n_kv_heads, "head_dim": t.resolved_head_dim,
        "hidden_act": "silu", "max_position_embeddings": max_len, "rms_norm_eps": t.norm_eps,
        "rope_theta": t.rope_theta, "rope_parameters": rope,  # transformers >= 5
        "rope_scaling": None if t.rope_scaling == "none" else {k: v for k, v in rope.items() if k != "rope_theta"},
        "tie_word_embeddings": t.tie_embeddings, "attention_dropout": 0.0, "dtype": dtype, "torch_dtype": dtype,
        "use_cache": True,
    }
    if family in ("llama",):
        out.update(attention_bias=False, mlp_bias=False)
    if family == "mistral":
        out["sliding_window"] = None
    if family == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=t.n_layers)
    return out


# ------------------------------------------------------------------------------------------------
# Vision tower (CLIP / SigLIP) and LLaVA projector


def vision_rules(v: VisionConfig, prefix: str, family: str) -> list[Rule]:
    """`prefix` ends in "vision_model."; only the first v.n_layers encoder layers are used."""
    e, nh = v.dim, v.n_heads
    d, p, c = e // nh, v.patch_size, v.channels
    L = f"{prefix}encoder.layers.{{i}}."
    pair = lambda x: (x,)

    def qkv_load(q, k, w):  # three [E, E] (out, in) -> [E_in, 3, nh, d]
        return np.stack([x.T.reshape(e, nh, d) for x in (q, k, w)], axis=1)

    def qkv_save(w):
        return tuple(_t(w[:, j].reshape(e, e)) for j in range(3))

    def norm(mm: str, hf: str, layered: bool = False) -> list[Rule]:
        return [Rule(f"{mm}/scale", (hf + ".weight",), _same, pair, layered),
                Rule(f"{mm}/bias", (hf + ".bias",), _same, pair, layered)]

    emb = f"{prefix}embeddings."
    rules = [
        Rule("vision/patch_embed", (emb + "patch_embedding.weight",),  # conv [E, C, p, p] -> [(py, px, c), E]
             lambda w: w.transpose(2, 3, 1, 0).reshape(p * p * c, e),
             lambda w: (np.ascontiguousarray(w.reshape(p, p, c, e).transpose(3, 2, 0, 1)),)),
        Rule("vision/pos_embed", (emb + "position_embedding.weight",), _same, pair),
        *norm("vision/layers/attn_norm", L + "layer_norm1", True),
        Rule("vision/layers/qkv", tuple(L + f"self_attn.{x}_proj.weight" for x in "qkv"), qkv_load, qkv_save, True),
        Rule("vision/layers/qkv_bias", tuple(L + f"self_attn.{x}_proj.bias" for x in "qkv"),
             lambda q, k, w: np.stack([x.reshape(nh, d) for x in (q, k, w)]),
             lambda b: tuple(b[j].reshape(-1) for j in range(3)), True),
        Rule("vision/layers/out", (L + "self_attn.out_proj.weight",), lambda w: w.T.reshape(nh, d, e),
             lambda w: (_t(w.reshape(e, e)),), True),
        Rule("vision/layers/out_bias", (L + "self_attn.out_proj.bias",), _same, pair, True),
        *norm("vision/layers/mlp_norm", L + "layer_norm2", True),
        Rule("vision/layers/fc1", (L + "mlp.fc1.weight",), _t, lambda w: (_t(w),), True),
        Rule("vision/layers/fc1_bias", (L + "mlp.fc1.bias",), _same, pair, True),
        Rule("vision/layers/fc2", (L + "mlp.fc2.weight",), _t, lambda w: (_t(w),), True),
        Rule("vision/layers/fc2_bias", (L + "mlp.fc2.bias",), _same, pair, True),
    ]
    if family == "clip_vision_model":
        rules += [Rule("vision/class_embed", (emb + "class_embedding",), _same, pair),
                  *norm("vision/pre_norm", prefix + "pre_layrnorm")]
    else:
        rules.append(Rule("vision/patch_bias", (emb + "patch_embedding.bias",), _same, pair))
    return rules


def projector_rules(prefix: str) -> list[Rule]:
    pair = lambda x: (x,)
    return [Rule("projector/fc1", (prefix + "linear_1.weight",), _t, lambda w: (_t(w),)),
            Rule("projector/fc1_bias", (prefix + "linear_1.bias",), _same, pair),
            Rule("projector/fc2", (prefix + "linear_2.weight",), _t, lambda w: (_t(w),)),
            Rule("projector/fc2_bias", (prefix + "linear_2.bias",), _same, pair)]


def vision_config_from_hf(hf: dict[str, Any], feature_layer: int, preprocessor: dict[str, Any] | None) -> VisionConfig:
    family = hf.get("model_type")
    if family not in VISION_FAMILIES:
        raise ConversionError(f"vision model_type={family!r} is not supported; "
                              f"supported: {', '.join(VISION_FAMILIES)}")
    act = HF_ACT.get(hf.get("hidden_act", "quick_gelu"))
    if act is None:
        raise ConversionError(f"vision hidden_act={hf.get('hidden_act')!r} has no mmjax equivalent "
                              f"({', '.join(HF_ACT)})")
    total = hf["num_hidden_layers"]
    if not isinstance(feature_layer, int):
        raise ConversionError(f"vision_feature_layer={feature_layer!r} (several layers) is not supported; "
                              "use one layer")
    used = total + 1 + feature_layer if feature_layer < 0 else feature_layer  # hidden_states[k] = after k layers
    if not 1 <= used <= total:
        raise ConversionError(f"vision_feature_layer={feature_layer} selects no encoder layer of {total}")
    pre = preprocessor or {}
    clip = family == "clip_vision_model"
    return VisionConfig(
        image_size=hf["image_size"], patch_size=hf["patch_size"], channels=hf.get("num_channels", 3),
        dim=hf["hidden_size"], n_layers=used, n_heads=hf["num_attention_heads"], mlp_dim=hf["intermediate_size"],
        norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
        mean=tuple(pre.get("image_mean", CLIP_MEAN if clip else (0.5, 0.5, 0.5))),
        std=tuple(pre.get("image_std", CLIP_STD if clip else (0.5, 0.5, 0.5))),
        pos_embed="learned", class_token=clip, pre_norm=clip, final_norm=False, act=act,
    )


def vision_config_to_hf(v: VisionConfig, dtype: str) -> dict[str, Any]:
    if v.final_norm:
        raise ConversionError("model.vision.final_norm=true: LLaVA reads tower features before any final "
                              "LayerNorm, so this tower has no exact Hugging Face form")
    if v.pos_embed != "learned":
        raise ConversionError(f"model.vision.pos_embed={v.pos_embed}: CLIP/SigLIP towers need learned positions")
    if v.class_token != v.pre_norm:
        raise ConversionError("a tower with class_token != pre_norm is neither CLIP (both) nor SigLIP (neither)")
    act = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[v.act]
    out = {"model_type": "clip_vision_model" if v.class_token else "siglip_vision_model",
           "hidden_size": v.dim, "intermediate_size": v.mlp_dim, "num_hidden_layers": v.n_layers,
           "num_attention_heads": v.n_heads, "num_channels": v.channels, "image_size": v.image_size,
           "patch_size": v.patch_size, "hidden_act": act, "layer_norm_eps": v.norm_eps, "attention_dropout": 0.0,
           "dtype": dtype, "torch_dtype": dtype}
    if not v.class_token:
        out["vision_use_head"] = False
    return out


# ------------------------------------------------------------------------------------------------
# Whole models


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a Hugging Face checkpoint keeps each part (names differ between transformers versions)."""

    decoder: str
    lm_head: str
    vision: str = ""
    projector: str = ""


def find_layout(keys: list[str], llava: bool) -> Layout:
    """Locate each part by a tensor only it has; prefixes differ between transformers versions and towers
    ("language_model.model." / "model.language_model.", "vision_tower.vision_model." / "vision_tower.")."""
    def prefix(suffix: str, what: str) -> str:
        found = sorted(k[: -len(suffix)] for k in keys if k.endswith(suffix))
        if len(found) != 1:
            raise ConversionError(f"cannot locate the {what}: {len(found)} tensors end in {suffix!r} "
                                  f"({found[:3]}); is this the model family config.json names?")
        return found[0]

    decoder = prefix("embed_tokens.weight", "decoder")
    heads = [k for k in keys if k.endswith("lm_head.weight")]
    lm_head = heads[0] if heads else "lm_head.weight"
    if not llava:
        return Layout(decoder, lm_head)
    return Layout(decoder, lm_head, prefix("embeddings.patch_embedding.weight", "vision tower"),
                  prefix("linear_1.weight", "projector"))


# What exports write: the layout of the llava-hf checkpoints, which every transformers version loads.
EXPORT_LAYOUT = {False: Layout("model.", "lm_head.weight"),
                 True: Layout("language_model.model.", "language_model.lm_head.weight",
                              "vision_tower.vision_model.", "multi_modal_projector.")}


KEPT_FIELDS = ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


def kept_fields(hf: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The config.json values an export writes back as they were (mmjax has no setting of its own for them): the
    decoder's context length and token ids ("text"), and a LLaVA's top-level token ids ("top")."""
    text = hf.get("text_config", hf) if hf.get("model_type") == "llava" else hf
    kept = {"text": {k: text[k] for k in KEPT_FIELDS if text.get(k) is not None}}
    if text is not hf:
        kept["top"] = {k: hf[k] for k in KEPT_FIELDS[1:] if hf.get(k) is not None}
    return kept


def model_config_from_hf(hf: dict[str, Any], preprocessor: dict[str, Any] | None, max_seq_len: int,
                         param_dtype: str) -> tuple[ModelConfig, dict[str, Any]]:
    """(mmjax ModelConfig, hf info for meta) from a config.json dict."""
    family = hf.get("model_type")
    info: dict[str, Any] = {"family": family, "kept": kept_fields(hf)}
    if family == "llava":
        text_hf, vision_hf = hf["text_config"], hf["vision_config"]
        # mmjax feeds the decoder exactly the patch tokens: CLIP + "default" (drop [CLS]), SigLIP + "full".
        strategy = hf.get("vision_feature_select_strategy", "default")
        want = "default" if hf["vision_config"].get("model_type") == "clip_vision_model" else "full"
        if strategy != want:
            raise ConversionError(f"vision_feature_select_strategy={strategy!r} with a "
                                  f"{hf['vision_config'].get('model_type')} tower does not feed exactly the patch "
                                  f"tokens; only {want!r} converts")
        if hf.get("projector_hidden_act", "gelu") != "gelu":
            raise ConversionError(f"projector_hidden_act={hf['projector_hidden_act']!r}; mmjax's projector uses gelu")
        if not hf.get("multimodal_projector_bias", True):
            raise ConversionError("multimodal_projector_bias=false is not supported (mmjax's projector has biases)")
        text = text_config_from_hf(text_hf)
        vision = vision_config_from_hf(vision_hf, hf.get("vision_feature_layer", -2), preprocessor)
        image_seq = hf.get("image_seq_length")
        if image_seq is not None and image_seq != vision.num_patches:
            raise ConversionError(f"image_seq_length={image_seq} but the tower gives {vision.num_patches} patches")
        info.update(image_token_id=int(hf.get("image_token_id", hf.get("image_token_index"))),
                    text_family=text_hf.get("model_type"), vision_family=vision_hf.get("model_type"),
                    vision_layers_total=vision_hf["num_hidden_layers"])
        vocab = text_hf["vocab_size"]
        max_pos = text_hf.get("max_position_embeddings", max_seq_len)
        cfg = ModelConfig(vocab_size=vocab, text=text, vision=vision, projector=ProjectorConfig(hidden_dim=0),
                          image_attention="causal", max_seq_len=min(max_seq_len, max_pos), param_dtype=param_dtype)
    else:
        text = text_config_from_hf(hf)
        max_pos = hf.get("max_position_embeddings", max_seq_len)
        window = hf.get("sliding_window") if family == "mistral" else None
        length = min(max_seq_len, max_pos, window or max_pos)
        info["text_family"] = family
        cfg = ModelConfig(vocab_size=hf["vocab_size"], text=text, max_seq_len=length, param_dtype=param_dtype)
    return cfg, info


def rules_for(cfg: ModelConfig, layout: Layout, llava: bool, vision_family: str = "") -> list[Rule]:
    rules = decoder_rules(cfg.text, layout.decoder, layout.lm_head)
    if llava:
        rules += vision_rules(cfg.vision, layout.vision, vision_family) + projector_rules(layout.projector)
    return rules

