"""Device memory of compiled steps (`mmjax.observe.memory`): a step that cannot fit is refused when it compiles,
naming the batch shape; an out-of-memory failure while training ends the run with a `DeviceMemoryError` that
says what to change. The CPU has no allocator limit, so limits are given; its out-of-memory failure is real
(an allocation larger than the machine)."""

import jax
import jax.numpy as jnp
import pytest

from mmjax.config import load_config
from mmjax.errors import DeviceMemoryError
from mmjax.observe.memory import check_fits, compiled_bytes, device_memory_limit, is_device_oom
from mmjax.training.compiled import CompiledSteps

HUGE = 2**38  # float32 elements: 1 TiB, more than any machine here, so XLA's CPU allocation fails at once


def _step(state, batch):
    return {"w": state["w"] + batch["tokens"].sum()}, {"loss": state["w"].sum()}


def test_compiled_bytes_counts_arguments_outputs_and_temporaries():
    state = {"w": jnp.zeros((256, 256))}
    batch = {"tokens": jnp.zeros((2, 8), jnp.int32)}
    need = compiled_bytes(jax.jit(_step).lower(state, batch).compile())
    assert need is not None and need >= 2 * 256 * 256 * 4  # the state in and out (nothing donated)
    donated = compiled_bytes(jax.jit(_step, donate_argnums=0).lower(state, batch).compile())
    assert donated is not None and donated <= need


def test_a_step_that_cannot_fit_is_refused_when_it_compiles():
    state = {"w": jnp.zeros((256, 256))}
    small, large = {"tokens": jnp.zeros((2, 8), jnp.int32)}, {"tokens": jnp.zeros((4, 16), jnp.int32)}
    exe = jax.jit(_step).lower(state, small).compile()
    check_fits(exe, "anything", None)                       # no limit known (the CPU): nothing to check
    check_fits(exe, "anything", compiled_bytes(exe))        # exactly enough
    steps = CompiledSteps(jax.jit(_step), memory_limit=1000)
    with pytest.raises(DeviceMemoryError, match=r"batches of 4 rows x 16 tokens needs .* GiB .*global_batch_size"):
        steps.warm_up(state, large)
    assert steps.count == 0                                 # nothing refused is kept
    steps = CompiledSteps(jax.jit(_step), memory_limit=None)
    steps.warm_up(state, large)
    assert steps.count == 1 and device_memory_limit() is None


def test_out_of_memory_while_training_names_the_step_and_the_remedies(tmp_path):
    from mmjax.training.trainer import Trainer
    cfg = load_config(None, ["model.text.dim=32", "model.text.mlp_dim=64", "model.text.n_layers=1",
                             "model.vision.dim=32", "model.vision.mlp_dim=64", "model.vision.n_layers=1",
                             "data.num_train=64", "data.num_eval=8", "data.num_shards=1", "eval.num_examples=8",
                             "train.global_batch_size=8", "train.steps=3", "observe.log_every=1",
                             "observe.sinks=[jsonl]", f"data.cache_dir={tmp_path}/cache",
                             f"train.output_dir={tmp_path}/run", "checkpoint.enabled=false"])
    trainer = Trainer(cfg)

    @jax.jit
    def too_big(state, batch):  # a real allocation failure, as a step too large for the device gives
        big = jnp.sort(jnp.arange(HUGE, dtype=jnp.float32) * batch["tokens"][0, 0])  # sorted in a temporary
        return state, {"train/loss": big[-1]}

    trainer._train_step = too_big
    with pytest.raises(DeviceMemoryError, match=r"ran out of memory in a train step up to step 1 \(this step: "
                                                r"batches of 8 rows x \d+ tokens.*train.global_batch_size") as err:
        trainer.run()
    assert is_device_oom(err.value.__cause__)
    assert not is_device_oom(ValueError("x must be [M, K]"))
