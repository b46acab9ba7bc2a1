import json
import pickle
import re

import pytest

from mmjax.data.builtin.shapes import COLORS, KINDS, NUMBERS, POSITIONS
from mmjax.data.tokenizer import Tokenizer, train_bpe_tokenizer
from mmjax.errors import DataError

ANSWERS = [*COLORS, *KINDS, *NUMBERS, *POSITIONS, "yes", "no"]


def test_round_trip_and_specials(tokenizer):
    for text in [*ANSWERS, "\nWhat color is the triangle?", "Is there an orange cross?", "unseen wörds ✓ 123"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = {tokenizer.image_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.user_id,
           tokenizer.assistant_id}
    assert len(ids) == 6 and max(ids) < tokenizer.vocab_size <= 512
    # answers are learned as single tokens or nearly so
    assert max(len(tokenizer.encode(a)) for a in ANSWERS) <= 2
    # special-token text inside records is data, not control
    assert tokenizer.eos_id not in tokenizer.encode("a <|eos|> b")
    assert tokenizer.decode([*tokenizer.encode("red"), tokenizer.eos_id, *tokenizer.encode("blue")]) == "red"


def test_chat_template_and_loss_mask(tokenizer):
    conv = [{"role": "user", "content": "<image>\nWhat color is the triangle?"},
            {"role": "assistant", "content": "bottom right"}]
    ids, mask = tokenizer.encode_chat(conv, 9)
    answer = tokenizer.encode("bottom right")
    question = tokenizer.encode("\nWhat color is the triangle?")
    assert ids == [tokenizer.bos_id, tokenizer.user_id, *[tokenizer.image_id] * 9, *question,
                   tokenizer.assistant_id, *answer, tokenizer.eos_id]
    assert mask == [0] * (len(ids) - len(answer) - 1) + [1] * (len(answer) + 1)

    prompt, pmask = tokenizer.encode_chat(conv, 9, add_generation_prompt=True)
    assert prompt == ids[: len(ids) - len(answer) - 1] and prompt[-1] == tokenizer.assistant_id
    assert sum(pmask) == 0

    llava = [{"from": "human", "value": "<image>\nhi"}, {"from": "gpt", "value": "yes"},
             {"from": "human", "value": "again?"}, {"from": "gpt", "value": "no"}]
    ids, mask = tokenizer.encode_chat(llava, 2)
    assert ids.count(tokenizer.image_id) == 2 and ids.count(tokenizer.eos_id) == 2
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "yes"  # stops at the first eos
    masked = [i for i, m in zip(ids, mask) if m]
    assert masked == [*tokenizer.encode("yes"), tokenizer.eos_id, *tokenizer.encode("no"), tokenizer.eos_id]

    with pytest.raises(DataError, match="role"):
        tokenizer.encode_chat([{"role": "robot", "content": "x"}], 1)


def test_from_file_errors(tmp_path, shapes_files):
    with pytest.raises(DataError, match="does not exist"):
        Tokenizer.from_file(tmp_path / "missing.json")
    bad = tmp_path / "bad" / "tokenizer.json"
    bad.parent.mkdir()
    bad.write_text("{not json")
    with pytest.raises(DataError, match="not a valid"):
        Tokenizer.from_file(bad)
    # a tokenizer without our special tokens, named through tokenizer_config.json
    path = train_bpe_tokenizer(["some text"], 300, tmp_path / "t")
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps({"image_token": "<|vision|>"}))
    with pytest.raises(DataError, match=re.escape("lacks the special token '<|vision|>'")):
        Tokenizer.from_file(path)
    # directory path and pickling (Grain workers) work
    tok = Tokenizer.from_file(shapes_files.root)
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode("What shape?") == tok.encode("What shape?") and clone.eos_id == tok.eos_id


def test_add_bos_token_flags_are_not_token_names(chat_tokenizer_dirs, tmp_path):
    """Llama-2-style tokenizer_config.json files carry `add_bos_token: true` / `add_eos_token: false`: flags, not
    special tokens; they load and render as transformers renders them."""
    import shutil

    import transformers as T

    folder = shutil.copytree(chat_tokenizer_dirs["qwen2"], tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False,
                                                              "add_eos_token": False}))
    tok = Tokenizer.from_file(folder)
    chat = [{"role": "user", "content": "hello"}]
    want = T.AutoTokenizer.from_pretrained(folder).apply_chat_template(chat, add_generation_prompt=True,
                                                                       tokenize=False)
    assert tok.chat_text(chat, add_generation_prompt=True) == want
