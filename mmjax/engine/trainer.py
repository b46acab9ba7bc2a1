"""The training loop: config -> mesh, data, model, state -> jitted steps -> metrics and evals.

Read top to bottom, `Trainer.run` is one training run. Step metrics stay on device until a log
interval (`observe.log_every`), when they are fetched in one transfer and written to every sink.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from mmjax.config import Config, to_yaml
from mmjax.data.pipeline import load_eval_examples, make_train_dataset, open_dataset
from mmjax.engine.evaluate import Evaluator, make_generate_fn
from mmjax.engine.feed import DeviceFeed
from mmjax.engine.init import create_train_state, model_setup
from mmjax.engine.optimizer import learning_rate_schedule, make_optimizer
from mmjax.engine.steps import make_train_step
from mmjax.observe.metrics import MetricBuffer
from mmjax.observe.sinks import JsonlSink, MetricWriter, ProgressSink
from mmjax.parallel.mesh import data_parallel_size, make_mesh, resolve_mesh_shape
from mmjax.parallel.sharding import context_from_config, in_sharding_context

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.output_dir = Path(cfg.train.output_dir).expanduser()
        self.mesh = make_mesh(cfg)
        self.mesh_sizes = resolve_mesh_shape(cfg.mesh, self.mesh.devices.size)
        self.files, self.tokenizer = open_dataset(cfg)

        self.setup = model_setup(cfg, self.mesh, image_token_id=self.tokenizer.image_id)
        self.optimizer = make_optimizer(cfg)
        self.schedule = learning_rate_schedule(cfg)
        self.state, state_shardings = create_train_state(cfg, self.mesh, self.setup, self.optimizer)
        step_fn = make_train_step(self.setup.graphdef, self.optimizer, self.schedule, cfg.train.grad_accum_steps,
                                  grad_shardings=self.setup.plan.grads)
        step_fn = in_sharding_context(step_fn, context_from_config(cfg, self.mesh))  # activation constraints
        self._train_step = jax.jit(step_fn, out_shardings=(state_shardings, None), donate_argnums=0)

        eval_set = load_eval_examples(cfg, self.tokenizer, self.files)
        generate = make_generate_fn(self.setup.graphdef, max_new_tokens=cfg.eval.max_new_tokens,
                                    eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id)
        self.evaluator = Evaluator(eval_set, self.tokenizer, generate, self.mesh, cfg.eval.batch_size,
                                   data_parallel_size(self.mesh_sizes))
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state.params))
        log.info("model: %.2fM parameters; mesh %s (%d processes, ZeRO-%d%s)", n_params / 1e6, self.mesh_sizes,
                 jax.process_count(), cfg.parallel.zero_stage,
                 ", sequence-parallel" if cfg.parallel.sequence_parallel else "")

    def run(self) -> dict[str, float]:
        """Train for `train.steps`, evaluating every `eval.every_steps` and at the end; returns the last eval."""
        cfg = self.cfg
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.yaml").write_text(to_yaml(cfg))
        sinks: list[Any] = [JsonlSink(self.output_dir / "metrics.jsonl")]
        if cfg.observe.progress:
            sinks.append(ProgressSink(cfg.train.steps))
        writer = MetricWriter(sinks)
        loader = iter(make_train_dataset(cfg, self.tokenizer, files=self.files, process_index=jax.process_index(),
                                         process_count=jax.process_count()))
        feed = DeviceFeed(loader, self.mesh, depth=cfg.data.prefetch)
        buffer = MetricBuffer()
        last_eval: dict[str, float] = {}
        try:
            batch = next(feed)
            compile_start = time.perf_counter()
            train_step = self._train_step.lower(self.state, batch).compile()
            writer.write(0, {"time/compile_train_step": time.perf_counter() - compile_start})
            wait = feed.last_wait
            interval_start = time.perf_counter()
            for step in range(1, cfg.train.steps + 1):
                if step > 1:
                    batch = next(feed)
                    wait += feed.last_wait
                self.state, metrics = train_step(self.state, batch)
                buffer.add(metrics)
                if step % cfg.observe.log_every == 0 or step == cfg.train.steps:
                    steps_done = len(buffer)
                    values = buffer.flush()  # the only host sync of the interval
                    elapsed = time.perf_counter() - interval_start
                    values["train/tokens_per_sec"] = values.pop("train/tokens") / elapsed
                    values["time/step"] = elapsed / steps_done
                    values["data/wait_time"] = wait / steps_done
                    writer.write(step, values)
                    wait, interval_start = 0.0, time.perf_counter()
                every = cfg.eval.every_steps
                if (every and step % every == 0) or step == cfg.train.steps:
                    eval_start = time.perf_counter()
                    last_eval, _ = self.evaluator.run(self.state.params)
                    last_eval["time/eval"] = time.perf_counter() - eval_start
                    writer.write(step, last_eval)
                    interval_start += last_eval["time/eval"]  # eval time is not train step time
        finally:
            feed.close()
            writer.close()
        return last_eval
