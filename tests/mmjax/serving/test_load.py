"""Serving a checkpoint: `LLM.from_checkpoint` on a written tiny checkpoint generates exactly what the
in-memory model does (text and image prompts, tokenizer found from the run's config); an imported Llama
serves as text-only and matches transformers' greedy decoding; bad paths fail in one line."""

import dataclasses
import json

import jax
import numpy as np
import pytest
import torch
import transformers as T
from flax import nnx
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from mmjax.checkpoint.convert import import_hf
from mmjax.checkpoint.orbax_state import FORMAT_VERSION, Checkpointer
from mmjax.config import Config, DataConfig, to_dict
from mmjax.data.tokenizer import SPECIAL_TOKENS
from mmjax.errors import CheckpointError, ModelError
from mmjax.model.layers import params_in_layout
from mmjax.serving.engine import LLM
from mmjax.serving.load import load_model
from mmjax.serving.request import SamplingParams

SERVE = ["serve.page_size=4", "serve.num_pages=24", "serve.max_num_batched_tokens=32", "serve.max_num_seqs=4",
         "serve.min_token_bucket=8", "serve.max_model_len=40"]


def write_tokenizer(folder, vocab: int) -> str:
    """Word-level: the six special tokens take ids 0..5 (image = 3), then words w6.. up to `vocab`."""
    words = {text: i for i, text in enumerate(SPECIAL_TOKENS.values())} | {f"w{i}": i for i in range(6, vocab)}
    tok = HFTokenizer(models.WordLevel(words, unk_token="w6"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({f"{r}_token": t for r, t in SPECIAL_TOKENS.items()}))
    return str(folder / "tokenizer.json")


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    """A params-only checkpoint (steps 2 and 5) of a tiny MLLM whose run config names its tokenizer."""
    root = tmp_path_factory.mktemp("load")
    tok_path = write_tokenizer(root / "tok", 64)
    model_cfg = tiny["config"]()
    model = tiny["model"](model_cfg, seed=3)
    cfg = dataclasses.replace(Config(), model=model_cfg, data=DataConfig(tokenizer=tok_path))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    writer = Checkpointer(root / "checkpoints", keep=0, async_save=False)
    for step, p in [(2, {"decoder": params["decoder"]}), (5, params)]:
        meta = {"format_version": FORMAT_VERSION, "kind": "params", "step": step, "config": to_dict(cfg)}
        meta["config"]["data"]["an_old_key"] = 1  # sections other than model may hold keys of other versions
        writer.save_params(step, p, meta)
    writer.close()
    return dict(root=root, model=model, cfg=cfg, tok_path=tok_path, tiny=tiny)


def test_checkpoint_generates_like_the_in_memory_model(run):
    llm = LLM.from_checkpoint(run["root"] / "checkpoints", tokenizer=None, overrides=SERVE)
    assert llm.engine.model_cfg == run["model"].cfg and llm.engine.image_token_id == 3
    serve_cfg = dataclasses.replace(run["cfg"], serve=llm.engine.serve)
    ref = LLM(serve_cfg, run["model"], llm.engine.tokenizer)
    rng = np.random.default_rng(0)
    image = rng.standard_normal((8, 8, 3)).astype(np.float32)
    prompts = ["w7 w9 w30 w12", "w40 w41 w8", [3, 3, 3, 3] + rng.integers(6, 64, 5).tolist()]
    images = [None, None, [image]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    got = llm.generate(prompts, params, images)
    want = ref.generate(prompts, params, images)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want] and got[0].text
    assert len(set(tuple(o.token_ids) for o in got)) == 3  # the prompts (and the image) make a difference


def test_scanned_checkpoint_serves_with_unrolled_layers(run):
    """Serving picks its own layer loop: a scanned run's checkpoint loads into unrolled layers (and such a
    model's params stack back to the checkpoint's), generating the same tokens."""
    scanned = LLM.from_checkpoint(run["root"] / "checkpoints", tokenizer=None,
                                  overrides=[*SERVE, "serve.unroll_layers=false"])  # the scan, served as it is
    unrolled = LLM.from_checkpoint(run["root"] / "checkpoints", tokenizer=None,
                                   overrides=[*SERVE, "model.scan_layers=false"])
    assert run["model"].cfg.scan_layers and not unrolled.engine.model_cfg.scan_layers
    assert scanned.engine.runner.graphdef == nnx.split(run["model"])[0]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = ["w7 w9 w30 w12", [3, 3, 3, 3, 9, 11]]
    images = [None, [np.random.default_rng(1).standard_normal((8, 8, 3)).astype(np.float32)]]
    assert ([o.token_ids for o in unrolled.generate(prompts, params, images)]
            == [o.token_ids for o in scanned.generate(prompts, params, images)])
    _, model = load_model(run["root"] / "checkpoints", overrides=["model.scan_layers=false"])
    unrolled_params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert sorted(unrolled_params["decoder"]["layers"]) == list(range(run["model"].cfg.text.n_layers))
    restacked = params_in_layout(unrolled_params, scan=True)
    want = nnx.to_pure_dict(nnx.state(run["model"], nnx.Param))
    assert jax.tree.structure(restacked) == jax.tree.structure(want)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restacked), jax.tree.leaves(want)))
    with pytest.raises(ModelError, match="not numbered 0..1"):
        params_in_layout({"decoder": {"layers": {0: {"w": np.zeros(2)}, 2: {"w": np.zeros(2)}}}}, scan=True)


def test_step_dtype_and_towers(run):
    ckpt = run["root"] / "checkpoints"
    cfg, model = load_model(ckpt / "5", dtype="bfloat16", tokenizer=run["tok_path"])
    assert cfg.model.param_dtype == "bfloat16" and model.image_token_id == 3
    assert nnx.state(model, nnx.Param)["decoder"]["embedding"][...].dtype == "bfloat16"
    cfg, model = load_model(ckpt, step=2)  # a decoder-only checkpoint serves text-only by itself
    assert model.text_only and cfg.model.text_only
    with pytest.raises(CheckpointError, match=r"lacks the towers \['vision', 'projector'\].*only the decoder"):
        load_model(ckpt, step=2, overrides=["model.text_only=false"])
    want = run["model"].decoder.embedding[...]
    assert np.array_equal(np.asarray(model.decoder.embedding[...]), np.asarray(want))


def test_bad_paths_fail_in_one_line(run, tmp_path):
    for call, message in [(lambda: LLM.from_checkpoint(tmp_path / "nope", None), "does not exist"),
                          (lambda: load_model(run["root"] / "checkpoints", step=4), r"no step 4; steps: \[2, 5\]"),
                          (lambda: load_model(run["root"] / "checkpoints", overrides=["model.txt_only=true"]),
                           "did you mean model.text_only")]:
        with pytest.raises(Exception, match=message) as e:
            call()
        assert "\n" not in str(e.value) and e.type.__module__.startswith("mmjax")


def test_imported_llama_serves_text_only(tmp_path):
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = T.LlamaForCausalLM(T.LlamaConfig(**text))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    hf.eval().save_pretrained(tmp_path / "hf")
    write_tokenizer(tmp_path / "hf", 64)
    import_hf(tmp_path / "hf", tmp_path / "mm")
    llm = LLM.from_checkpoint(tmp_path / "mm", None, overrides=[*SERVE, "model.compute_dtype=float32"])
    assert llm.engine.model_cfg.text_only
    prompt = [1, 17, 40, 9, 22, 51]
    [out] = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    assert out.token_ids == ids[0, len(prompt):].tolist()


def test_offline_api_prints_no_orbax_read_only_notices(hf_llama_dir, tmp_path):
    """Every reader opens checkpoints read-only on purpose; Orbax's absl warnings about it are not shown by the
    offline API (a fresh process, as a user's script: no handler of mmjax's own is installed)."""
    import subprocess
    import sys

    from mmjax.observe.console import ORBAX_NOTICES

    ckpt = import_hf(hf_llama_dir, tmp_path / "ckpt").parent
    script = ("import sys; from mmjax.serving.engine import LLM; from mmjax.serving.request import SamplingParams\n"
              "llm = LLM.from_checkpoint(sys.argv[1], overrides=['serve.num_pages=16', 'serve.max_num_seqs=1'])\n"
              "print(llm.generate(['Hello'], SamplingParams(max_tokens=2))[0].token_ids)")
    run = subprocess.run([sys.executable, "-c", script, str(ckpt)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("[") and not [n for n in ORBAX_NOTICES if n in run.stderr], run.stderr[-2000:]
