"""Command-line tools; each module only parses arguments and calls library code.

    python -m mmjax.tools.convert_checkpoint   Hugging Face <-> mmjax checkpoints (also `mmjax-convert`)
    python -m mmjax.tools.get_model            a real model (SmolLM2-135M-Instruct) or a GGUF file -> HF folder
    python -m mmjax.tools.prepare_data         LLaVA JSON / Parquet -> sharded ArrayRecord (`mmjax-prepare-data`)
    python -m mmjax.tools.train_tokenizer      BPE tokenizer of the model's vocab size (`mmjax-train-tokenizer`)
    python -m mmjax.tools.plot_metrics         metrics.jsonl of one or more runs -> PNGs (`mmjax-plot`)
    python -m mmjax.tools.bench_train          train-step throughput, MFU, memory, profile summary
    python -m mmjax.tools.bench_data           loader throughput against data.num_workers
    python -m mmjax.tools.bench_checkpoint     checkpoint save/restore time and the training stall per save
    python -m mmjax.tools.bench_kernels        every fused kernel against XLA, cuDNN and torch SDPA
    python -m mmjax.tools.bench_serving        offline serving: decode tok/s vs HBM roofline, TTFT, mixed load, HF peer;
                                               --server URL: Poisson load on a running `mmjax.serve`, latency vs rate
    python -m mmjax.tools.bench_mgpu_bwd       Mosaic GPU flash-attention backward candidates (H100/H200)
    python -m mmjax.tools.sweep_attention      flash-attention tile sweep (GPU)
    python -m mmjax.tools.sweep_rows           launch-shape sweep of the row-wise kernels (GPU)
    python -m mmjax.bench.decode_sweep   decode tiling of the ragged paged attention (GPU)
    python -m mmjax.bench.serving_host         host time per engine step (scheduling, inputs, outputs; CPU is fine)

Benchmarks write JSON into `docs/perf/results/<area>/` relative to the working directory unless `--out` says otherwise.
"""
