"""The real model every machine can fetch: SmolLM2-135M-Instruct (`python -m mmjax.tools.get_model`), against
`transformers` on the same folder: the chat template renders to the same ids, and greedy answers are the same
tokens. The folder is fetched and converted once into the user's cache (`$MMJAX_CACHE` moves it) and reused by
later runs; the module is marked `real_model` (`-m "not real_model"` leaves it out)."""

import pytest
import torch
import transformers as T

from mmjax.checkpoint.known_models import model_folder
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
def smollm2():
    return model_folder("smollm2-135m-instruct")


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


def test_greedy_answers_equal_transformers(smollm2, hf_answers, tmp_path_factory):
    from mmjax.engine.convert.init_from import converted_copy
    from mmjax.serving.engine import LLM
    from mmjax.serving.request import SamplingParams

    hf_tok, answers = hf_answers
    assert "Paris" in hf_tok.decode(answers[0][1])  # a real model, not random weights
    ckpt = converted_copy(smollm2, "float32", tmp_path_factory.mktemp("cache"))
    llm = LLM.from_checkpoint(ckpt, Tokenizer.from_file(smollm2),
                              overrides=["serve.max_num_seqs=3", "serve.num_pages=64", "serve.min_token_bucket=4",
                                         "serve.max_num_batched_tokens=64"])
    outs = llm.generate([ids for ids, _ in answers], SamplingParams(max_tokens=MAX_TOKENS))
    for out, (_, want) in zip(outs, answers):
        got = [t for t in out.token_ids if t != hf_tok.eos_token_id]
        assert got == want, (hf_tok.decode(got), hf_tok.decode(want))
