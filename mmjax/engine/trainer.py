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

import kernels
from mmjax.config import Config, to_yaml
from mmjax.data.pipeline import load_eval_examples, make_train_dataset, open_dataset
from mmjax.engine.evaluate import Evaluator, make_generate_fn
from mmjax.engine.feed import DeviceFeed
from mmjax.engine.init import create_train_state, model_setup
from mmjax.engine.optimizer import learning_rate_schedule, make_optimizer
from mmjax.engine.steps import make_train_step
from mmjax.observe.monitor import TrainMonitor
from mmjax.parallel.mesh import data_parallel_size, make_mesh, resolve_mesh_shape
from mmjax.parallel.sharding import context_from_config, in_sharding_context

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.output_dir = Path(cfg.train.output_dir).expanduser()
        # Hook: save_fn(state, step) writes a checkpoint; observe.nan_policy=halt calls it before stopping.
        self.save_fn: Any = None
        self.monitor = TrainMonitor(cfg)  # its watchdog reports what start-up waits for if it hangs
        self.monitor.phase("the JAX backend and the device mesh (multi-host: every process must join)")
        self.mesh = make_mesh(cfg)
        self.mesh_sizes = resolve_mesh_shape(cfg.mesh, self.mesh.devices.size)
        self.monitor.phase("the dataset and tokenizer to be prepared")
        self.files, self.tokenizer = open_dataset(cfg)

        self.monitor.phase("the model and optimizer state to be initialised")
        self.setup = model_setup(cfg, self.mesh, image_token_id=self.tokenizer.image_id)
        self.optimizer = make_optimizer(cfg)
        self.schedule = learning_rate_schedule(cfg)
        self.state, state_shardings = create_train_state(cfg, self.mesh, self.setup, self.optimizer)
        step_fn = make_train_step(self.setup.graphdef, self.optimizer, self.schedule, cfg.train.grad_accum_steps,
                                  skip_nonfinite=cfg.observe.nan_policy != "warn",
                                  grad_shardings=self.setup.plan.grads)
        step_fn = in_sharding_context(step_fn, context_from_config(cfg, self.mesh))  # activation constraints
        self._train_step = jax.jit(step_fn, out_shardings=(state_shardings, None), donate_argnums=0)

        self.monitor.phase("the evaluation set to load")
        eval_set = load_eval_examples(cfg, self.tokenizer, self.files)
        generate = make_generate_fn(self.setup.graphdef, max_new_tokens=cfg.eval.max_new_tokens,
                                    eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id)
        self.evaluator = None if eval_set is None else Evaluator(  # None: user data without data.eval_paths
            eval_set, self.tokenizer, generate, self.mesh, cfg.eval.batch_size, data_parallel_size(self.mesh_sizes))
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state.params))
        log.info("model: %.2fM parameters; mesh %s (%d processes, ZeRO-%d%s)", n_params / 1e6, self.mesh_sizes,
                 jax.process_count(), cfg.parallel.zero_stage,
                 ", sequence-parallel" if cfg.parallel.sequence_parallel else "")
        self.monitor.idle()

    def run(self) -> dict[str, float]:
        """Train for `train.steps`, evaluating every `eval.every_steps` and at the end; returns the last eval."""
        cfg = self.cfg
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.yaml").write_text(to_yaml(cfg))
        monitor = self.monitor
        monitor.open(self.output_dir, self.mesh, cfg.train.steps, save_fn=self.save_fn,
                     dynamic_loss_scale=self.state.loss_scale.dynamic)
        loader = iter(make_train_dataset(cfg, self.tokenizer, files=self.files, process_index=jax.process_index(),
                                         process_count=jax.process_count()))
        feed = DeviceFeed(loader, self.mesh, depth=cfg.data.prefetch)
        last_eval: dict[str, float] = {}
        try:
            with monitor.waiting_for("the first batch from the data loader"):
                batch = next(feed)
            with monitor.waiting_for("XLA to compile the train step"):
                with kernels.sharding(self.mesh):  # custom kernels trace per shard (kernels/_sharding.py)
                    train_step = self._train_step.lower(self.state, batch).compile()
            monitor.write(0, {})  # time/compile/train_step
            monitor.training()
            for step in range(1, cfg.train.steps + 1):
                if step > 1:
                    batch = next(feed)
                monitor.data(feed)
                monitor.before_step(step, self.state)
                self.state, metrics = train_step(self.state, batch)
                monitor.after_step(step, self.state, metrics)
                if step % cfg.observe.log_every == 0 or step == cfg.train.steps:
                    # the only host sync of the interval; the loader adds its rate, padding and skips
                    stats = getattr(loader, "stats", None)  # a plain iterator (tests, custom loaders) has none
                    monitor.log(step, self.state, extra=stats.interval_metrics() if stats else None)
                every = cfg.eval.every_steps
                if self.evaluator is not None and ((every and step % every == 0) or step == cfg.train.steps):
                    with monitor.excluded("the evaluation to finish"):  # eval time is not train step time
                        eval_start = time.perf_counter()
                        last_eval, _ = self.evaluator.run(self.state.params)
                        last_eval["time/eval"] = time.perf_counter() - eval_start
                    monitor.write(step, last_eval)
        finally:
            feed.close()
            monitor.close()
        return last_eval
