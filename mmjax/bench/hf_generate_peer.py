"""Hugging Face `generate` throughput, the peer of `mmjax.bench.serving`, run in its own process.

    python -m mmjax.bench.hf_generate_peer '{"config": {...}, "batches": [1, 32], "prompt_len": 512, "new_tokens": 128,
                                      "dtype": "bfloat16", "allow_cpu": false, "seed": 0}'

Builds `transformers.LlamaForCausalLM` from the given config dict (random init, `dtype`, on CUDA), times greedy
`generate` of `new_tokens` tokens (EOS ignored) and of 1 token (the prefill) per batch, and prints one line
`HF_PEER_RESULT {json}`. Imports no JAX: JAX would preallocate the GPU memory torch needs. Without torch,
transformers or CUDA (and `allow_cpu` false) the result is `{"skipped": why}`.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from mmjax.bench.peer_process import peer_main, torch_and_device

PREFIX = "HF_PEER_RESULT "  # mmjax.bench.serving.HF_RESULT_PREFIX


def run(config: dict, batches: list[int], prompt_len: int, new_tokens: int, dtype: str = "bfloat16",
        allow_cpu: bool = False, seed: int = 0, num_beams: int = 1) -> dict[str, Any]:
    found = torch_and_device(allow_cpu, "--hf-on-cpu")
    if isinstance(found, dict):
        return found
    torch, transformers, device = found
    torch.manual_seed(seed)
    hf_cfg = transformers.LlamaConfig(**config)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_cfg).to(getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # generate exactly new_tokens, like ignore_eos

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def generate(ids: Any, n: int) -> float:
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0, num_beams=num_beams)
        sync()
        if out.shape[1] != ids.shape[1] + n:
            raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} tokens, expected {n}")
        return time.perf_counter() - t0

    rows = []
    for b in batches:
        ids = torch.randint(0, hf_cfg.vocab_size, (b, prompt_len), device=device)
        generate(ids, min(new_tokens, 4))  # warm-up: kernels, allocator
        full, prefill = generate(ids, new_tokens), generate(ids, 1)
        rows.append({"batch": b, "e2e_s": full, "prefill_s": prefill, "e2e_tok_s": b * new_tokens / full,
                     "decode_tok_s": b * (new_tokens - 1) / (full - prefill) if full > prefill else None})
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": dtype,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "attn_implementation": getattr(model.config, "_attn_implementation", None), "num_beams": num_beams,
            "rows": rows}


if __name__ == "__main__":
    sys.exit(peer_main(run, PREFIX))
