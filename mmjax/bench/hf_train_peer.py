"""Hugging Face transformers + torch training throughput, the peer of `mmjax.tools.bench_train`, in its own process.

    python -m mmjax.bench.hf_train_peer '{"config": {...}, "batch": 8, "seq": 2048, "steps": 12, "warmup": 3,
                                           "compile": true, "allow_cpu": false, "seed": 0}'

The same recipe as mmjax's default step: float32 parameters and AdamW state, bfloat16 autocast compute, SDPA
attention, fused AdamW (on CUDA), next-token cross-entropy over every position. `compile` wraps the model in
`torch.compile`. Prints one line `HF_TRAIN_PEER_RESULT {json}`. Imports no JAX: JAX would preallocate the GPU
memory torch needs. Without torch, transformers or CUDA (and `allow_cpu` false) the result is `{"skipped": why}`.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from mmjax.bench.peer_process import peer_main, torch_and_device

PREFIX = "HF_TRAIN_PEER_RESULT "


def run(config: dict, batch: int, seq: int, steps: int = 12, warmup: int = 3, compile: bool = True,
        allow_cpu: bool = False, seed: int = 0, lr: float = 3e-4) -> dict[str, Any]:
    found = torch_and_device(allow_cpu, "--peer-on-cpu")
    if isinstance(found, dict):
        return found
    torch, transformers, device = found
    torch.manual_seed(seed)
    hf_cfg = transformers.LlamaConfig(**{**config, "dtype": "float32", "torch_dtype": "float32", "use_cache": False})
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(hf_cfg, attn_implementation="sdpa").float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device == "cuda")
    forward = torch.compile(model) if compile else model
    ids = torch.randint(0, hf_cfg.vocab_size, (batch, seq), device=device)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def step() -> Any:
        """One training step; returns the loss on the device (no host sync inside the timed loop)."""
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    t0 = time.perf_counter()
    first_loss = float(step())  # the first step compiles (torch.compile) and autotunes
    for _ in range(warmup - 1):
        step()
    sync()
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    step_s = (time.perf_counter() - t0) / steps
    return {"peer": f"hf-torch-{'compile' if compile else 'eager'}",
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "batch": batch, "seq": seq,
            "steps": steps, "warmup_s": warmup_s, "step_s": step_s, "tokens_per_s": batch * seq / step_s,
            "loss_first_step": first_loss,
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
            "params": sum(p.numel() for p in model.parameters())}


if __name__ == "__main__":
    sys.exit(peer_main(run, PREFIX))
