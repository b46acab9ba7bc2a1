"""`python -m mmjax.generate` on a Hugging Face folder: the same greedy text as `transformers`' generate."""

import torch
import transformers as T

from mmjax.generate import main


def test_generate_matches_transformers_greedy(hf_llama_dir, tmp_path, capsys):
    messages = [{"role": "system", "content": "You are a cat."}, {"role": "user", "content": "Hello there"}]
    tok = T.PreTrainedTokenizerFast.from_pretrained(hf_llama_dir)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    hf = T.LlamaForCausalLM.from_pretrained(hf_llama_dir).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    want = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert out.shape[1] - len(ids) >= 8 and want.strip()  # a real continuation, not an immediate stop

    argv = [str(hf_llama_dir), "--prompt", "Hello there", "--system", "You are a cat.", "--max-tokens", "12",
            "--cache-dir", str(tmp_path), "serve.num_pages=64", "serve.max_num_seqs=1"]
    assert main(argv) == 0
    assert capsys.readouterr().out == want + "\n"
    assert main(["hf:" + str(tmp_path / "missing"), "--prompt", "x"]) == 1
    assert "is not a folder" in capsys.readouterr().err


def test_generate_json_gives_ids_text_logprobs_and_finish_reason(hf_llama_dir, tmp_path, capsys):
    import json

    import numpy as np

    tok = T.PreTrainedTokenizerFast.from_pretrained(hf_llama_dir)
    hf = T.LlamaForCausalLM.from_pretrained(hf_llama_dir).eval()
    argv = [str(hf_llama_dir), "--prompt", "Hello there", "--max-tokens", "5", "--cache-dir", str(tmp_path), "--json",
            "--logprobs", "2", "serve.num_pages=64", "serve.max_num_seqs=1"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert out["prompt_token_ids"] == ids and len(out["token_ids"]) == len(out["logprobs"]) == 5
    assert out["finish_reason"] == "length" and out["text"] == tok.decode(out["token_ids"], skip_special_tokens=True)
    with torch.no_grad():  # the chosen tokens' logprobs, as transformers computes them for the same sequence
        logits = hf(torch.tensor([ids + out["token_ids"]])).logits[0, len(ids) - 1:-1].double()
    want = torch.log_softmax(logits, -1)[torch.arange(5), torch.tensor(out["token_ids"])].numpy()
    np.testing.assert_allclose(out["logprobs"], want, atol=1e-4)
    assert [step[0]["id"] for step in out["top_logprobs"]] == out["token_ids"]  # greedy: the most likely one
    assert all(len(step) == 2 for step in out["top_logprobs"])
