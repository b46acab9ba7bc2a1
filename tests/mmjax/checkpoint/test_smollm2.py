"""The real model every machine can fetch: SmolLM2-135M-Instruct (`python -m mmjax.tools.get_model`), against
`transformers` on the same folder: the chat template renders to the same ids, and greedy answers are the same
tokens. The folder is fetched and converted once into the user's cache (`$MMJAX_CACHE` moves it) and reused by
later runs (the `smollm2` fixture, conftest.py); the module is marked `real_model` (`-m "not real_model"` leaves
it out)."""

import pytest
import torch
import transformers as T

from mmjax.data.tokenizer import Tokenizer, render_chat

pytestmark = pytest.mark.real_model

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Name three primary colours."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "What is 12 + 7?"}],
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def converted(smollm2, tmp_path_factory):
    """A data.cache_dir holding SmolLM2's float32 mmjax weights, converted once for the module: the greedy test
    serves them and the fine-tune's `model.init_from` finds them there (`converted_copy` reuses a conversion)."""
    from mmjax.checkpoint.convert.init_from import converted_copy

    cache = tmp_path_factory.mktemp("cache")
    return cache, converted_copy(smollm2, "float32", cache)


@pytest.fixture(scope="module")
def hf_answers(smollm2):
    """(prompt ids, greedy answer ids without the final eos) of every chat, from transformers in float32."""
    tok = T.AutoTokenizer.from_pretrained(smollm2)
    model = T.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    out = []
    for chat in CHATS:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.no_grad():
            full = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        answer = full[0, len(ids):].tolist()
        out.append((ids, answer[:-1] if answer[-1] == tok.eos_token_id else answer))
    return tok, out


def test_chat_template_renders_as_transformers(smollm2, hf_answers):
    hf_tok, answers = hf_answers
    ours = Tokenizer.from_file(smollm2)
    for chat, (ids, _) in zip(CHATS, answers):
        assert render_chat(ours, chat, add_generation_prompt=True) == ids
        text = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert ours.chat_text(chat, add_generation_prompt=True) == text
    assert ours.stop_ids == [hf_tok.eos_token_id] and ours.bos_id == hf_tok.bos_token_id


def test_greedy_answers_equal_transformers(smollm2, hf_answers, converted):
    from mmjax.serving.engine import LLM
    from mmjax.serving.request import SamplingParams

    hf_tok, answers = hf_answers
    assert "Paris" in hf_tok.decode(answers[0][1])  # a real model, not random weights
    _, ckpt = converted
    llm = LLM.from_checkpoint(ckpt, Tokenizer.from_file(smollm2),
                              overrides=["serve.max_num_seqs=3", "serve.num_pages=64", "serve.min_token_bucket=4",
                                         "serve.max_num_batched_tokens=64"])
    outs = llm.generate([ids for ids, _ in answers], SamplingParams(max_tokens=MAX_TOKENS))
    for out, (_, want) in zip(outs, answers):
        got = [t for t in out.token_ids if t != hf_tok.eos_token_id]
        assert got == want, (hf_tok.decode(got), hf_tok.decode(want))


RECORDS = [{"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
           for i, (q, a) in enumerate([("What colour is the sky on a clear day?", "Blue."), ("What is 2 + 2?", "4."),
                                       ("Name a fruit.", "An apple."), ("What is the capital of Italy?", "Rome.")])]
STEPS = 3  # a pass over the four examples (batches of 2) and one batch more: the last loss is below the first


@pytest.mark.slow
def test_full_fine_tune_exports_with_the_same_logits(smollm2, converted, tmp_path):
    """Every weight trains (float32, 3 steps on four chat examples: the loss falls and the weights move), the run
    exports to a Hugging Face folder, and transformers' logits of that folder equal mmjax's of the trained
    parameters; the exported config keeps the source's context length and token ids. The run starts from the
    module's converted weights (its data.cache_dir), as a second run from the same folder would."""
    import json

    import jax
    import numpy as np

    from mmjax.checkpoint.convert import export_hf
    from mmjax.checkpoint.convert.init_from import load_run_config
    from mmjax.serving.load import build_model
    from mmjax.training.trainer import Trainer

    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    cfg = load_run_config("finetune_llava.yaml", [
        f"model.init_from=hf:{smollm2}", f"data.paths=[{data}]", f"data.cache_dir={converted[0]}",
        f"train.output_dir={tmp_path / 'run'}", "model.max_seq_len=64", "model.compute_dtype=float32",
        "model.remat=none", "data.packing=false", "data.num_workers=0", "train.global_batch_size=2",
        f"train.steps={STEPS}", "optim.warmup_steps=0", "optim.lr=1e-4", "observe.sinks=[jsonl]",
        "observe.log_every=1", "checkpoint.every_steps=0", "checkpoint.async=false"])
    trainer = Trainer(cfg, devices=jax.devices()[:1])  # a batch of 2 on one device: the CPU's real layout
    trainer.run()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(x)["train/loss"] for x in lines if "train/loss" in x]
    assert len(losses) == STEPS and np.isfinite(losses).all() and losses[-1] < losses[0]

    out = export_hf(tmp_path / "run" / "checkpoints", tmp_path / "hf")
    exported = json.loads((out / "config.json").read_text())
    source = json.loads((smollm2 / "config.json").read_text())
    for key in ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        assert exported[key] == source[key], key
    tokens = np.asarray([Tokenizer.from_file(out).encode("The capital of Italy is Rome, and of France")], np.int32)
    pos = np.arange(tokens.shape[1], dtype=np.int32)[None]
    mm = build_model(cfg, jax.tree.map(np.asarray, jax.device_get(trainer.state.params)), image_token_id=0)
    ours = np.asarray(mm(tokens, pos, np.ones_like(tokens)))
    with torch.no_grad():
        theirs = T.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(
            torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        before = T.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()(
            torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(ours - theirs).max() < 1e-3 < np.abs(theirs - before).max()  # exact export; the weights moved
