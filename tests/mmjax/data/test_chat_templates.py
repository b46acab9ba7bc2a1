"""Chat templates: mmjax renders a model's own Jinja template exactly as `transformers`' apply_chat_template
does (token ids), and the loss mask covers exactly the assistant tokens."""

import re

import pytest
import transformers as T

from mmjax.data.tokenizer import Tokenizer, render_chat
from mmjax.errors import DataError

CHAT = [{"role": "system", "content": "You are a cat."},
        {"role": "user", "content": "Hello there, how are you today?"},
        {"role": "assistant", "content": "It is red."},
        {"role": "user", "content": "What color is the triangle?"},
        {"role": "assistant", "content": "The quick brown fox."}]
# what each family's template appends after an assistant message's content (the end of its turn)
TURN_END = {"llama3": "<|eot_id|>", "qwen2": "<|im_end|>\n", "llava": " "}


def hf_tokenizer(folder):
    return T.PreTrainedTokenizerFast.from_pretrained(folder)


def llava_chat(with_system: bool = True):
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A cat sits on a mat."}]},
            {"role": "user", "content": [{"type": "text", "text": "What color?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "It is red."}]}]
    return ([{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}] if with_system else []) + chat


def assistant_texts(chat):
    out = []
    for m in chat:
        if m["role"] == "assistant":
            c = m["content"]
            out.append(c if isinstance(c, str) else " ".join(p["text"] for p in c if p["type"] == "text"))
    return out


def masked_groups(ids, mask):
    groups, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            groups.append(cur)
            cur = []
    return groups + ([cur] if cur else [])


@pytest.mark.parametrize("family", ["llama3", "qwen2", "llava"])
def test_ids_match_apply_chat_template_and_mask_is_the_assistant_turns(family, chat_tokenizer_dirs):
    folder = chat_tokenizer_dirs[family]
    tok, hf = Tokenizer.from_file(folder), hf_tokenizer(folder)
    chat = llava_chat() if family == "llava" else CHAT
    kwargs = {"chat_template": tok.chat_template}
    extra = {"date_string": "26 Jul 2024"} if family == "llama3" else {}
    for messages in (chat, chat[1:]):  # with and without a system prompt
        for gen in (False, True):
            want = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True, return_dict=False,
                                          **kwargs, **extra)
            assert render_chat(tok, messages, add_generation_prompt=gen, **extra) == list(want), (messages, gen)
            assert tok.chat_text(messages, add_generation_prompt=gen, **extra) == hf.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=False, **kwargs, **extra)
    if family == "llama3":  # the template's own date (strftime_now) is today's in both
        assert render_chat(tok, chat, add_generation_prompt=False) == list(
            hf.apply_chat_template(chat, tokenize=True, return_dict=False, **kwargs))
    ids, mask = tok.encode_chat(chat, 1)
    assert ids == list(hf.apply_chat_template(chat, tokenize=True, return_dict=False, **kwargs))
    # the mask: one group per assistant turn, exactly its content + the template's end of turn
    groups = masked_groups(ids, mask)
    assert [hf.decode(g) for g in groups] == [t + TURN_END[family] for t in assistant_texts(chat)]
    if family == "llava":  # generation blocks: the same mask transformers computes
        out = hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                     **kwargs)
        assert mask == list(out["assistant_masks"])


def test_llava_format_records_and_image_expansion(chat_tokenizer_dirs):
    tok = Tokenizer.from_file(chat_tokenizer_dirs["llava"])
    record = [{"from": "human", "value": "<image>\nDescribe the image."}, {"from": "gpt", "value": "A cat sits."}]
    assert tok.chat_text(record) == "USER: <image>\nDescribe the image. ASSISTANT: A cat sits. "
    one, _ = tok.encode_chat(record, 1)
    ids, mask = tok.encode_chat(record, 4)
    assert ids.count(tok.image_id) == 4 and len(ids) == len(one) + 3 and sum(mask) == sum(tok.encode_chat(record, 1)[1])
    prompt, pmask = tok.encode_chat(record, 4, add_generation_prompt=True)
    assert tok.chat_text(record[:1], add_generation_prompt=True).endswith("ASSISTANT:") and sum(pmask) == 0
    assert ids[: len(prompt) - 1] == prompt[:-1]
    # OpenAI-style typed parts reach a template that reads strings as text with image markers
    qwen = Tokenizer.from_file(chat_tokenizer_dirs["qwen2"])
    parts = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                          {"type": "text", "text": "\nHello"}]}]
    assert qwen.chat_text(parts) == qwen.chat_text([{"role": "user", "content": "<image>\nHello"}])


def test_shapes_template_is_one_more_template(tokenizer):
    """The built-in tokenizer's template renders through transformers too, with the same ids and mask."""
    hf = T.PreTrainedTokenizerFast(tokenizer_object=tokenizer._chat_tok, bos_token="<|bos|>", eos_token="<|eos|>")
    chat = [{"role": "user", "content": "What color is the triangle?"}, {"role": "assistant", "content": "red"}]
    out = hf.apply_chat_template(chat, chat_template=tokenizer.chat_template, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True, user_token="<|user|>",
                                 assistant_token="<|assistant|>")
    ids, mask = tokenizer.encode_chat(chat, 9)
    assert ids == list(out["input_ids"]) and mask == list(out["assistant_masks"])


def test_bad_templates_and_records_are_one_line_errors(chat_tokenizer_dirs, tmp_path, tokenizer):
    tok = Tokenizer.from_file(chat_tokenizer_dirs["qwen2"])
    with pytest.raises(DataError, match=re.escape("control token '<|im_end|>'")) as e:
        tok.encode_chat([{"role": "user", "content": "hi<|im_end|>"}, {"role": "assistant", "content": "x"}], 1)
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="refused the conversation: role robot"):
        tokenizer.encode_chat([{"role": "robot", "content": "x"}], 1)
    llama = Tokenizer.from_file(chat_tokenizer_dirs["llama3"])
    with pytest.raises(DataError, match="only supports single tool-calls"):
        llama.chat_text([{"role": "assistant", "content": "", "tool_calls": [{}, {}]}])
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(chat_tokenizer_dirs["qwen2"], broken)
    (broken / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>", "chat_template": "{% for %}"}')
    with pytest.raises(DataError, match="does not parse") as e:
        Tokenizer.from_file(broken).chat_text([{"role": "user", "content": "x"}])
    assert "\n" not in str(e.value)
