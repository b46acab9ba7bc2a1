"""The training loop: config -> mesh, data, model, state -> jitted steps -> metrics and evals.

Read top to bottom, `Trainer.run` is one training run. Step metrics stay on device until a log
interval (`observe.log_every`), when they are fetched in one transfer and written to every sink.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax

from mmjax.checkpoint import orbax_state as ckpt
from mmjax.checkpoint.convert import save_tokenizer_files
from mmjax.checkpoint.convert.init_from import converted_weights
from mmjax.config import Config, to_yaml
from mmjax.data.pipeline import load_eval_examples, make_train_dataset, open_dataset
from mmjax.observe.memory import device_memory_limit, is_device_oom, oom_error
from mmjax.observe.monitor import TrainMonitor
from mmjax.observe.params import log_parameter_overview
from mmjax.parallel.mesh import make_mesh, resolve_mesh_shape
from mmjax.parallel.sharding import context_from_config
from mmjax.training.checks import check_runnable
from mmjax.training.compiled import CompiledSteps, describe
from mmjax.training.evaluate import Evaluator, make_eval_engine, write_predictions
from mmjax.training.feed import DeviceFeed
from mmjax.training.init import create_train_state, model_setup
from mmjax.training.jit_step import jit_train_step
from mmjax.training.optimizer import learning_rate_schedule, make_optimizer, resumed_schedule_warning
from mmjax.training.pipeline.canonical import CanonicalLayout

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config, devices: list | None = None):
        self.cfg = cfg
        self.output_dir = Path(cfg.train.output_dir).expanduser()
        # Hook: save_fn(state, step) writes a checkpoint; observe.nan_policy=halt calls it before stopping.
        # None = the run's own checkpointer (when checkpoint.enabled).
        self.save_fn: Any = None
        self.monitor = TrainMonitor(cfg)  # its watchdog reports what start-up waits for if it hangs
        self.monitor.phase("the JAX backend and the device mesh (multi-host: every process must join)")
        self.mesh = make_mesh(cfg, devices)
        self.mesh_sizes = resolve_mesh_shape(cfg.mesh, self.mesh.devices.size)
        check_runnable(cfg, self.mesh_sizes["pipeline"])
        # Checkpoints: this run's folder, and which checkpoint train.resume points at (checked before
        # anything is compiled, so a wrong path fails fast).
        self.checkpointer = ckpt.Checkpointer.from_config(cfg) if cfg.checkpoint.enabled else None
        resume_from = ckpt.find_resume(cfg, self.checkpointer)
        if resume_from is None and cfg.model.init_from:  # a fresh run starts from the Hugging Face weights

            resume_from = converted_weights(cfg)
        self.monitor.phase("the dataset and tokenizer to be prepared")
        self.files, self.tokenizer = open_dataset(cfg)
        if self.checkpointer is not None and jax.process_index() == 0:  # exports copy it from there
            save_tokenizer_files(cfg.data.tokenizer or self.files.tokenizer_path,
                                 self.checkpointer.directory / "tokenizer")

        self.monitor.phase("the model and optimizer state to be initialised")
        text_only_without_image = cfg.model.text_only and not self.tokenizer.has_image_token  # e.g. a Llama's
        image_token = 0 if text_only_without_image else self.tokenizer.image_id
        self.setup = model_setup(cfg, self.mesh, image_token_id=image_token)
        self.optimizer = make_optimizer(cfg)
        self.schedule = learning_rate_schedule(cfg)
        self.state, state_shardings = create_train_state(cfg, self.mesh, self.setup, self.optimizer)
        # checkpoints and evaluation see canonical layer order (a pipeline may store stages differently)
        self.canonical = CanonicalLayout(self.mesh, self.setup, self.optimizer, self.state)
        self.data_state: Any = None
        self.stop_requested = threading.Event()
        if resume_from is not None:
            reader, step = resume_from
            self.state, self.data_state, meta = self.canonical.restore(reader, step, self.state, cfg)
            warning = resumed_schedule_warning(meta.get("config") or {}, cfg, step) if meta else None
            if warning:
                log.warning("%s", warning)
        # one sharding context (rules, context parallelism, per-shard kernels) for training and evaluation
        self.sharding = context_from_config(cfg, self.mesh)
        self._train_step = jit_train_step(cfg, self.setup, self.optimizer, self.schedule, state_shardings,
                                          self.sharding)

        self.monitor.phase("the evaluation set to load")
        eval_set = load_eval_examples(cfg, self.tokenizer, self.files)
        self.evaluator = None  # None: user data without data.eval_paths
        if eval_set is not None:  # the serving engine, built once: evaluation compiles on the first eval only
            params = self.canonical.params_to_canonical(self.state.params)
            engine = make_eval_engine(cfg, self.setup.graphdef, params, self.tokenizer, eval_set, self.mesh,
                                      self.sharding)
            self.evaluator = Evaluator(eval_set, self.tokenizer, engine, cfg.eval.batch_size, cfg.eval.max_new_tokens)
        n_params = self.setup.num_params
        if jax.process_index() == 0:  # as the state holds them: with pipeline stage storage, padding rows too
            log_parameter_overview(self.state.params, "as stored, pipeline padding rows included"
                                   if self.setup.storage is not None else "")
        log.info("model: %.2fM parameters; mesh %s (%d processes, ZeRO-%d%s)", n_params / 1e6, self.mesh_sizes,
                 jax.process_count(), cfg.parallel.zero_stage,
                 ", sequence-parallel" if cfg.parallel.sequence_parallel else "")
        self.monitor.idle()

    def run(self) -> dict[str, float]:
        """Train for `train.steps`, evaluating every `eval.every_steps` and at the end; returns the last eval."""
        cfg = self.cfg
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.yaml").write_text(to_yaml(cfg))
        start = int(jax.device_get(self.state.step))
        if start >= cfg.train.steps:
            log.info("the checkpoint is at step %d >= train.steps=%d: nothing to train", start, cfg.train.steps)
            return {}
        loader = iter(make_train_dataset(cfg, self.tokenizer, files=self.files, process_index=jax.process_index(),
                                         process_count=jax.process_count()))
        if self.data_state is not None:
            loader.set_state(self.data_state)  # the batch after the checkpoint's last one
        feed = DeviceFeed(loader, self.mesh, depth=cfg.data.prefetch)
        save_fn = self.save_fn
        if save_fn is None and self.checkpointer is not None:  # observe.nan_policy=halt saves before stopping
            save_fn = lambda state, step: self._save(step, feed.loader_state, state)  # noqa: E731
        monitor = self.monitor
        monitor.open(self.output_dir, self.mesh, cfg.train.steps, start_step=start, save_fn=save_fn,
                     dynamic_loss_scale=self.state.loss_scale.dynamic)
        last_eval: dict[str, float] = {}
        restore_signals = self._catch_stop_signals()
        try:
            with monitor.waiting_for("the first batch from the data loader"):
                batch = next(feed)
            with monitor.waiting_for("XLA to compile the train step (every batch shape the loader announces)"):
                # one executable per bucket shape, each refused at once if it cannot fit the device
                train_step = CompiledSteps(self._train_step, memory_limit=device_memory_limit())
                train_step.warm_up(self.state, batch, getattr(loader, "batch_shapes", list)())
            monitor.write(start, {})  # time/compile/train_step
            monitor.training()
            for step in range(start + 1, cfg.train.steps + 1):
                if step > start + 1:
                    batch = next(feed)
                monitor.data(feed)
                monitor.before_step(step, self.state)
                try:  # steps run asynchronously: a step's failure surfaces here or at the next host sync
                    self.state, metrics = train_step(self.state, batch)
                    monitor.after_step(step, self.state, metrics)
                    stop = self._stop_now(step)
                    if step % cfg.observe.log_every == 0 or step == cfg.train.steps or stop:
                        # the only host sync of the interval; the loader adds its rate, padding and skips
                        stats = getattr(loader, "stats", None)  # a plain iterator (tests, custom loaders) has none
                        extra = {**(stats.interval_metrics() if stats else {}), "train/compiles": train_step.count}
                        monitor.log(step, self.state, extra=extra)
                except Exception as e:
                    if not is_device_oom(e):
                        raise
                    raise oom_error(e, f"a train step up to step {step} (this step: {describe(batch)}; "
                                       "checkpoints saved before it are kept)") from e
                if self.checkpointer is not None and (stop or step == cfg.train.steps or self.checkpointer.due(step)):
                    with monitor.excluded("a checkpoint save"):  # its stall shows in this metric, not time/step
                        blocked = self._save(step, feed.loader_state)
                    monitor.write(step, {"time/checkpoint_blocked": blocked})
                if stop:
                    log.warning("stop signal: saved step %d, exiting", step)
                    break
                every = cfg.eval.every_steps
                if self.evaluator is not None and ((every and step % every == 0) or step == cfg.train.steps):
                    with monitor.excluded("the evaluation to finish"):  # eval time is not train step time
                        eval_start = time.perf_counter()
                        last_eval, predictions = self.evaluator.run(
                            self.canonical.params_to_canonical(self.state.params))
                        last_eval["time/eval"] = time.perf_counter() - eval_start
                    monitor.write(step, last_eval)
                    if jax.process_index() == 0:
                        answers = Path(cfg.train.output_dir) / "eval" / f"step_{step:07d}.jsonl"
                        write_predictions(answers, self.evaluator.eval_set, predictions)
                        monitor.artifact(step, answers)  # to MLflow / Neptune
        finally:
            restore_signals()
            if self.checkpointer is not None:
                self.checkpointer.wait()  # a save in flight completes before the process may exit
            feed.close()
            monitor.close()
        return last_eval

    # -- checkpoints and preemption ---------------------------------------------------------------

    def _save(self, step: int, data_state: Any, state: Any = None) -> float:
        """Checkpoint `state` (default: the current one) at `step`; returns the seconds the loop was blocked."""
        meta = ckpt.run_meta(self.cfg, self.mesh_sizes, tuple(self.mesh.axis_names), step)
        state = self.state if state is None else state
        canonical = self.canonical.state_to_canonical(state)  # a fresh copy where the layouts differ
        return self.checkpointer.save(step, canonical, data_state, meta, owned=canonical is not state)

    def _stop_now(self, step: int) -> bool:
        """True once SIGTERM/SIGINT arrived. With several processes, jax's preemption service (which owns
        SIGTERM there) makes every process stop at the same step, as the save is collective."""
        if jax.process_count() > 1:
            return self.checkpointer is not None and self.checkpointer.manager.reached_preemption(step)
        return self.stop_requested.is_set()

    def _catch_stop_signals(self):
        """SIGTERM/SIGINT finish the current step, save and return; a second SIGINT interrupts at once."""
        if threading.current_thread() is not threading.main_thread() or jax.process_count() > 1:
            return lambda: None
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

        def handler(signum, frame):
            if self.stop_requested.is_set() and signum == signal.SIGINT:
                raise KeyboardInterrupt
            log.warning("received %s: stopping after this step", signal.Signals(signum).name)
            self.stop_requested.set()

        for sig in previous:
            signal.signal(sig, handler)
        return lambda: [signal.signal(sig, h) for sig, h in previous.items()]
