"""Distilling a draft model (`mmjax.training.distill`, `python -m mmjax.tools.distill_draft`): training a 1-layer
draft of a 2-layer random target on the target's own continuations raises its held-out top-1 agreement with the
target over the undistilled draft; the written checkpoint loads through `serve.speculative.draft_checkpoint` and
speculation with it leaves greedy output equal to plain decoding; the command line distills a chat model's
draft end to end and the speculation benchmark measures it (`--draft-checkpoint`); bad input fails clearly."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmjax.checkpoint.convert.init_from import converted_copy
from mmjax.config import Config, ModelConfig, ServeConfig, SpeculativeConfig, TextConfig
from mmjax.errors import ConfigError
from mmjax.model import MLLM
from mmjax.serving.engine import Engine
from mmjax.serving.load import load_model
from mmjax.serving.request import SamplingParams
from mmjax.tools import bench_serving, distill_draft
from mmjax.training.distill import DistillSpec, distill, init_draft, save_draft
from mmjax.training.distill_data import generate_sequences, split_by_prompt

SEQ_LEN = 32


class _Ids:
    """Detokenizer stand-in: no end of sequence, ids as text."""

    eos_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _target() -> MLLM:
    """A 2-layer text-only random MLLM (numpy-drawn weights, std 0.2, so both layers shape its output)."""
    cfg = ModelConfig(vocab_size=64, max_seq_len=64, compute_dtype="float32", text_only=True,
                      text=TextConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=48))
    model = nnx.eval_shape(lambda: MLLM(cfg, image_token_id=3, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.2, x.dtype),
                                   nnx.state(model, nnx.Param)))
    return model


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    target = _target()
    cfg = Config(model=target.cfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 64, rng.integers(3, 8)).tolist() for _ in range(40)]
    seqs = generate_sequences(cfg, target, _Ids(), prompts, seq_len=SEQ_LEN, samples=3, temperature=1.0,
                              max_num_seqs=32)
    held_prompts = set(range(30, 40))
    train, held = split_by_prompt(seqs, held_prompts)
    draft_cfg, draft = init_draft(cfg, target, 1)
    distiller, summary = distill(target, draft, train, held, DistillSpec(steps=40, batch=16, lr=1e-2, warmup=5,
                                                                         eval_every=20))
    out = tmp_path_factory.mktemp("draft") / "d1"
    save_draft(out, draft_cfg, distiller.draft_params(), dtype="float32")
    return dict(target=target, cfg=cfg, seqs=seqs, train=train, held=held, held_prompts=held_prompts,
                summary=summary, out=out, draft_cfg=draft_cfg)


def test_rows_are_the_targets_continuations(distilled):
    seqs = distilled["seqs"]
    assert len(seqs) == 120 and (seqs.lengths == SEQ_LEN).all()  # no end of sequence: every row full
    assert set(distilled["held"].prompt_ids.tolist()) == distilled["held_prompts"]
    assert not set(distilled["train"].prompt_ids.tolist()) & distilled["held_prompts"]
    greedy = seqs.take(np.arange(0, len(seqs), 3))  # each prompt's first row is greedy, the others sampled
    sampled = seqs.take(np.arange(1, len(seqs), 3))
    assert (greedy.tokens[:, :3] == sampled.tokens[:, :3]).all()  # the same prompt
    assert (greedy.tokens != sampled.tokens).any()


def test_distillation_raises_held_out_agreement(distilled):
    s = distilled["summary"]
    before, after = s["before"], s["after"]
    assert after["agreement"] > before["agreement"] + 0.05, (before, after)
    assert after["kl"] < 0.8 * before["kl"], (before, after)
    assert len(s["loss"]) == 40 and [e["step"] for e in s["evals"]] == [20]
    assert np.mean(s["loss"][-5:]) < np.mean(s["loss"][:5])


def test_draft_checkpoint_serves_speculation_with_plain_greedy_output(distilled):
    """The checkpoint loads as the draft model of `serve.speculative.draft_checkpoint`, in the draft step of the
    target's verifying call, and greedy tokens equal the plain engine's greedy rows."""
    _, draft = load_model(distilled["out"], overrides=("model.text_only=true",))
    assert draft.cfg.text.n_layers == 1 and draft.cfg.param_dtype == "float32"
    want = nnx.to_pure_dict(nnx.state(draft, nnx.Param))
    assert want["decoder"]["layers"]["attn_norm"]["scale"].shape[0] == 1
    seqs = distilled["seqs"].take(np.arange(0, 30, 3))  # greedy rows of ten prompts
    spec = SpeculativeConfig(method="draft", num_tokens=3, proposer_on_device=True,
                             draft_checkpoint=str(distilled["out"]))
    serve = ServeConfig(page_size=4, num_pages=96, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=SEQ_LEN,
                        max_logprobs=0, max_beam_width=0, speculative=spec)
    engine = Engine(dataclasses.replace(distilled["cfg"], serve=serve), distilled["target"], _Ids())
    prompts = [row[:p].tolist() for row, p in zip(seqs.tokens, seqs.prompt_lengths)]
    ids = [engine.add_request(p, sampling_params=SamplingParams(max_tokens=SEQ_LEN - len(p))) for p in prompts]
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    for rid, row, p in zip(ids, seqs.tokens, seqs.prompt_lengths):
        assert final[rid].token_ids == row[p:].tolist()
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0


def test_bad_distillation_input():
    target = _target()
    with pytest.raises(ConfigError, match="draft layers < the target's 2 layers"):
        init_draft(Config(model=target.cfg), target, 2)
    with pytest.raises(ConfigError, match="exceeds the target's model.max_seq_len"):
        generate_sequences(Config(model=target.cfg), target, _Ids(), [[5, 6]], seq_len=128)
    with pytest.raises(ConfigError, match="steps"):
        DistillSpec(steps=0).validate()


def test_command_line_distills_and_the_benchmark_measures_the_draft(hf_llama_dir, tmp_path, capsys):
    ckpt = converted_copy(hf_llama_dir, "float32", tmp_path / "cache")
    out = tmp_path / "draft"
    common = ["--model", str(ckpt), "--seq-len", "192", "--max-prompts", "20", "--samples", "2",
              "--gen-seqs", "16", "--no-text", "model.max_seq_len=512"]
    assert distill_draft.main([*common, "--draft-layers", "2", "--out", str(out)]) == 1
    assert "draft layers < the target's 2 layers" in capsys.readouterr().err
    assert distill_draft.main([*common, "--draft-layers", "1", "--steps", "30", "--batch", "8", "--lr", "1e-2",
                               "--eval-every", "0", "--out", str(out)]) == 0
    record = json.loads((out / "distill.json").read_text())
    assert record["draft_layers"] == 1 and record["target_layers"] == 2 and len(record["loss"]) == 30
    assert record["after"]["agreement"] > record["before"]["agreement"], record
    assert (out / "tokenizer" / "tokenizer.json").is_file() and (out / "model.yaml").is_file()
    assert distill_draft.main([*common, "--draft-layers", "1", "--out", str(out)]) == 1  # not over a draft
    assert "already exists" in capsys.readouterr().err

    result = tmp_path / "acceptance.json"
    assert bench_serving.main(["--mode", "spec-acceptance", "--model", str(ckpt), "--draft-checkpoint", str(out),
                               "--spec-methods", "none", "draft_device", "--spec-k", "2", "--new-tokens", "6",
                               "--out", str(result), "model.max_seq_len=1024"]) == 0
    r = json.loads(result.read_text())
    assert r["draft"] == "given" and r["draft_layers"] == 1 and r["draft_checkpoint"] == str(out)
    rows = [x for x in r["rows"] if x["method"] == "draft_device"]
    assert rows and all(x["same_as_plain"] and x["drafted"] > 0 for x in rows), rows


def test_missing_target_is_refused(tmp_path, capsys):
    assert distill_draft.main(["--model", str(tmp_path / "nothing"), "--out", str(tmp_path / "d")]) == 1
    assert "neither a known model" in capsys.readouterr().err
