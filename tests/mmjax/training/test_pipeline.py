"""Pipeline parallelism: schedules (pure Python) and the executor against pipeline=1.

Each pipeline layout trains 2 optimizer steps from the same initial state as a one-device run with the
same microbatches (train.grad_accum_steps) and must give the same losses, gradient norms and parameters
(float32, rel <= 1e-5); with Adam eps=1 and lr=1 the first update is ~linear in the gradient, so matching
parameters means matching gradients. The feature matrix is covered economically: every schedule, mesh
and feature at least once, not the full cross product (one compile per row of LAYOUTS).
"""

import itertools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))  # the layouts tests' model and batches
from test_layouts import IMAGE_ID, MODEL, make_batch, rel_err  # noqa: E402

from mmjax.config import load_config
from mmjax.errors import ConfigError
from mmjax.parallel.mesh import make_mesh
from mmjax.parallel.sharding import context_from_config
from mmjax.training.checks import check_runnable
from mmjax.training.feed import to_global_batch
from mmjax.training.init import create_train_state, model_setup, state_shardings
from mmjax.training.jit_step import jit_train_step
from mmjax.training.optimizer import learning_rate_schedule, make_optimizer
from mmjax.training.pipeline import schedule as sch
from mmjax.training.pipeline.balance import balance, make_layout
from mmjax.training.precision import LossScale

BASE = ["model.compute_dtype=float32", "train.global_batch_size=8", "train.grad_accum_steps=4",
        "optim.warmup_steps=0", "optim.schedule=constant", "optim.lr=1.0", "optim.eps=1.0", "train.steps=2",
        "model.text.n_layers=4", "model.vision.n_layers=1", "model.text.dim=64", "model.text.mlp_dim=128",
        "model.vision.dim=64", "model.vision.mlp_dim=128"]

LAYOUTS = {  # images + packed segments in every batch; tied embeddings unless said otherwise
    # cost balance with the head as 2 layers: stages of 3 and 1 layers (a padded slot on rank 1); the head's fused
    # chunked cross-entropy with the vocab split over `tensor` (the reference uses it too: a `model.` key)
    "gpipe_pp2_fsdp2_tp2_zero3_cost": ["mesh.data=1", "mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2",
                                       "parallel.pipeline_schedule=gpipe", "parallel.pipeline_balance=cost",
                                       "model.loss_impl=chunked"],
    # the batch axes manual in the executor (BatchSplit): gradients reduce-scattered once per step (ZeRO-3 above,
    # ZeRO-2 here) or all-reduced (replicated leaves)
    "1f1b_pp4_data2_zero2_even": ["mesh.data=2", "mesh.pipeline=4", "parallel.zero_stage=2",
                                  "parallel.pipeline_balance=even"],
    # float16 compute (reference attention: XLA:CPU has no float16 x float16 -> float32 dot for the XLA one), the
    # gradients reduce-scattered over fsdp and all-reduced over data once per step; 2 rows per microbatch
    "1f1b_pp2_data2_fsdp2_fp16": ["mesh.data=2", "mesh.pipeline=2", "mesh.fsdp=2", "train.grad_accum_steps=2",
                                  "model.compute_dtype=float16", "model.attention_impl=reference"],
    # ring attention: the executor runs every slot unconditionally (masked), as its permutes need every device
    "interleaved2_pp2_seq2_tp2_ring_zero1": ["mesh.data=1", "mesh.pipeline=2", "mesh.sequence=2",
                                             "mesh.tensor=2", "parallel.context_parallel=ring",
                                             "parallel.zero_stage=1",
                                             "parallel.pipeline_schedule=interleaved_1f1b",
                                             "parallel.pipeline_virtual_stages=2"],
}


# ---------------------------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("p, m, v", [(p, m, v) for p, m, v in itertools.product([2, 3, 4], [4, 6, 8, 12], [1, 2, 3])])
def test_bubble_fraction_matches_formula(p, m, v):
    built = [sch.gpipe(p, m), sch.one_f_one_b(p, m)] if v == 1 else []
    if m % p == 0:
        built.append(sch.interleaved_1f1b(p, v, m))
    for s in built:
        for t_f, t_b in [(1.0, 1.0), (1.0, 2.0)]:
            assert s.bubble_fraction(t_f, t_b) == pytest.approx((p - 1) / (s.v * m + p - 1), abs=1e-12), s.name


def test_schedule_shapes():
    p, m = 4, 16
    one = sch.one_f_one_b(p, m)
    warmup = [sum(1 for a in acts if a.kind == "F" and a.tick < min(b.tick for b in acts if b.kind == "B"))
              for acts in one.actions]
    assert warmup == [2 * (p - 1 - r) for r in range(p)]  # eager warm-up
    assert one.stash_depth() == 2 * p - 1 and sch.gpipe(p, m).stash_depth() == m
    assert sch.interleaved_1f1b(p, 2, m).stash_depth() == 3 * p - 1
    assert sch.one_f_one_b(p, 32).stash_depth() == one.stash_depth()  # flat in m
    grid = sch.interleaved_1f1b(2, 2, 4).grid().splitlines()
    assert grid[1].startswith("rank 0 |") and "F0a" in grid[1] and "B3a" in grid[1]
    for s in (sch.gpipe(3, 5), one, sch.interleaved_1f1b(2, 3, 4)):
        t = s.tables()
        assert t["f_valid"].sum() == t["b_valid"].sum() == p * 0 + s.p * s.v * s.m
        assert t["f_slot"].max() < s.stash_depth()


def test_balance_counts_the_head():
    assert balance(4, 2, 2.0) == (3, 1)  # costs 3 | 1 + 2
    assert balance(4, 2, 0.0) == (2, 2)
    assert balance(32, 4, 2.0) == (9, 9, 7, 7)
    lay = make_layout(4, 2, 2, "even", 2.0)
    idx, active = lay.index()
    assert idx[:, :, 0].tolist() == [[0, 2], [1, 3]] and active.all()  # stage s = chunk * p + rank


def test_csv_schedule_loads_checks_and_runs(tmp_path):
    """A CSV schedule round-trips; an edited one (every backward one tick later: one more stash slot) passes the
    check and the executor runs it to the built-in 1F1B's loss and gradients; broken files name their problem."""
    from jax.sharding import AxisType, Mesh

    from mmjax.training.pipeline.executor import run_schedule

    p, m, b, d = 2, 4, 2, 8
    one = sch.one_f_one_b(p, m)
    path = tmp_path / "one.csv"
    path.write_text(sch.to_csv(one))
    assert sch.load_csv(str(path), p, m).actions == one.actions
    lines = sch.to_csv(one).splitlines()
    shifted = [lines[0]] + [line if ",F," in line else
                            ",".join(str(int(x) + 1) if k == 1 else x for k, x in enumerate(line.split(",")))
                            for line in lines[1:]]
    path.write_text("\n".join(shifted))
    late = sch.load_csv(str(path), p, m)
    assert late.num_ticks == one.num_ticks + 1 and late.stash_depth() == one.stash_depth() + 1
    mesh = Mesh(np.asarray(jax.devices()[:p]).reshape(1, 1, p, 1, 1), ("data", "fsdp", "pipeline", "sequence",
                                                                         "tensor"), axis_types=(AxisType.Auto,) * 5)
    params = {"a": jax.random.normal(jax.random.key(0), (p, 1, 1, d, d))}
    x = jax.random.normal(jax.random.key(1), (m, b, d))

    def run(schedule):
        return jax.jit(lambda params, x: run_schedule(
            schedule, lambda w, x, side: jnp.tanh(x @ w["a"][0]), lambda hp, y, loss_in: (jnp.sum(y * hp), 1.0),
            params, jnp.linspace(-1, 1, d), x, jnp.zeros((m, 1)), jnp.zeros((m, 1)), 1.0, mesh))(params, x)

    for got, want in zip(jax.tree.leaves(run(late)), jax.tree.leaves(run(one)), strict=True):
        assert rel_err(np.asarray(got), np.asarray(want)) <= 1e-6
    broken = {"rank,tick,kind\n": "header", "\n".join(lines[:-1]): "lacks a forward or backward",
              "\n".join(lines + ["0,40,F,0,9"]): "outside", "\n".join([lines[0], "0,x,F,0,0"]): "integers"}
    for text, match in broken.items():
        path.write_text(text)
        with pytest.raises(ConfigError, match=match):
            sch.load_csv(str(path), p, m)
    with pytest.raises(ConfigError, match="cannot be read"):
        check_runnable(load_config(MODEL, ["mesh.pipeline=2", "train.grad_accum_steps=4",
                                           f"parallel.pipeline_schedule_file={tmp_path / 'missing.csv'}"]))


@pytest.mark.parametrize("n_layers, p, v, mode", [(5, 2, 1, "cost"), (4, 2, 2, "even"), (7, 2, 2, "cost")])
def test_stage_storage_holds_each_ranks_layers(n_layers, p, v, mode):
    """Storage rows in (rank, chunk, slot) order: rank r's equal block of rows is exactly the layers its stages
    run (padding rows zero), and canonical order comes back unchanged."""
    from mmjax.training.pipeline.stage_storage import StageStorage

    lay = make_layout(n_layers, p, v, mode, 2.0)
    storage = StageStorage(lay)
    layers = jnp.arange(1, n_layers + 1, dtype=jnp.float32)[:, None] * jnp.ones((1, 3))
    stored = np.asarray(storage.layers_to_storage(layers))
    idx, active = lay.index()
    want = np.where(active > 0, idx + 1, 0).reshape(p, -1)  # layer l holds l + 1; padding 0
    assert np.array_equal(stored[:, 0].reshape(p, -1), want)
    assert np.array_equal(np.asarray(storage.layers_to_canonical(stored)), np.asarray(layers))


@pytest.mark.parametrize("overrides, match", [
    (["mesh.pipeline=2", "train.grad_accum_steps=1"], "train.grad_accum_steps >= 2"),
    (["mesh.pipeline=2", "train.grad_accum_steps=4", "model.text.n_layers=3", "parallel.pipeline_balance=even"],
     "pipeline_balance=cost"),
    (["mesh.pipeline=2", "train.grad_accum_steps=3", "parallel.pipeline_schedule=interleaved_1f1b",
      "parallel.pipeline_virtual_stages=2", "train.global_batch_size=6"], "divisible by mesh.pipeline"),
    (["mesh.pipeline=2", "train.grad_accum_steps=4", "model.scan_layers=false"], "scan_layers=true"),
    (["mesh.pipeline=2", "train.grad_accum_steps=4", "parallel.pipeline_virtual_stages=2"], "interleaved_1f1b"),
    (["mesh.pipeline=2", "train.grad_accum_steps=4", "parallel.rules.batch=pipeline"], "owns"),
    (["mesh.pipeline=2", "mesh.data=4", "train.grad_accum_steps=4", "train.global_batch_size=8"], "multiple of 16"),
])
def test_bad_layouts_fail_at_config_time(overrides, match):
    """The run's config check (`python -m mmjax.train` exits 2 on it, before anything is built) asks the planner."""
    cfg = load_config(MODEL, overrides)
    with pytest.raises(ConfigError, match=match):
        check_runnable(cfg)


# ---------------------------------------------------------------------------------------------- executor


def train_two_steps(overrides, devices=None, initial=None):
    """(initial host state, final host state, [metrics of step 1, step 2]).

    The state starts with fp16's dynamic loss scaling (scale 2^10, growth every step), also where the compute
    is float32: the pipeline then runs its backward seeded with the scale and the step unscales, as with
    float16, and both steps' scales must agree with pipeline=1."""
    cfg = load_config(MODEL, BASE + overrides)
    mesh = make_mesh(cfg, devices)
    setup = model_setup(cfg, mesh, IMAGE_ID)
    optimizer = make_optimizer(cfg)
    if initial is None:
        state, _ = create_train_state(cfg, mesh, setup, optimizer)
        scale = LossScale(scale=jnp.asarray(1024.0, jnp.float32), good_steps=jnp.zeros((), jnp.int32),
                          skipped=jnp.zeros((), jnp.int32), growth_interval=1, factor=2.0)
        state = state.replace(loss_scale=scale)
        shardings = state_shardings(mesh, setup, optimizer, state)
        state = jax.device_put(state, shardings)
    else:  # a canonical (pipeline=1) state, in this layout's stage-order storage where it has one
        stored = initial if setup.storage is None else setup.storage.state_to_storage(initial, optimizer)
        shardings = state_shardings(mesh, setup, optimizer, stored)
        state = jax.device_put(stored, shardings)
    step = jit_train_step(cfg, setup, optimizer, learning_rate_schedule(cfg), shardings,
                          context_from_config(cfg, mesh))
    batches = [to_global_batch(make_batch(cfg, cfg.train.global_batch_size, seed=s), mesh) for s in (0, 1)]
    compiled = step.lower(state, batches[0]).compile()
    canonical = (lambda s: s) if setup.storage is None else (  # noqa: E731
        lambda s: setup.storage.state_to_canonical(s, optimizer))
    initial = jax.device_get(canonical(state))
    metrics = []
    for batch in batches:
        state, m = compiled(state, batch)
        metrics.append(jax.device_get(m))
    return initial, jax.device_get(canonical(state)), metrics


@pytest.fixture(scope="module")
def reference():
    out = {}

    def get(extra):
        key = tuple(extra)
        if key not in out:
            out[key] = train_two_steps(["mesh.data=1", *extra], jax.devices()[:1])
        return out[key]

    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_matches_pipeline_1(name, reference):
    overrides = LAYOUTS[name]
    model_keys = [o for o in overrides if o.startswith("model.")]
    # float16: sums in another order differ by a few float16 ulps (2^-10); float32: rel 1e-5
    metric_tol, param_tol = (5e-4, 2e-2) if "model.compute_dtype=float16" in overrides else (1e-5, 1e-5)
    initial, ref_state, ref_metrics = reference(model_keys)
    _, state, metrics = train_two_steps(overrides, initial=initial)
    for got, want in zip(metrics, ref_metrics):
        assert got["train/loss_scale"] == want["train/loss_scale"] and got["train/skipped_steps"] == 0
        for key in ("train/loss", "train/grad_norm", "train/loss_tokens"):
            assert abs(got[key] - want[key]) <= metric_tol * abs(want[key]), (key, got[key], want[key])
    leaves = jax.tree_util.tree_leaves_with_path(state.params)
    for (path, got), want in zip(leaves, jax.tree.leaves(ref_state.params), strict=True):
        assert rel_err(got, want) <= param_tol, (jax.tree_util.keystr(path), rel_err(got, want))
    for got, want in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(ref_state.opt_state), strict=True):
        assert rel_err(np.asarray(got, np.float64), np.asarray(want, np.float64)) <= param_tol
    assert float(state.loss_scale.scale) == 4096.0  # grew after each of the two finite steps
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(state.params),
                                                               jax.tree.leaves(initial.params)))
    assert moved > 1e-3


def test_1f1b_temp_memory_is_flat_in_microbatches_while_gpipe_grows():
    """Compiled temporary memory of the executor alone (a tanh-MLP stage with wide residuals) for m = 8, 32."""
    from jax.sharding import AxisType, Mesh

    from mmjax.training.pipeline.executor import run_schedule

    p, b, d, hidden = 2, 4, 8, 512
    mesh = Mesh(np.asarray(jax.devices()[:p]).reshape(1, 1, p, 1, 1), ("data", "fsdp", "pipeline", "sequence",
                                                                         "tensor"), axis_types=(AxisType.Auto,) * 5)

    def stage_fn(w, x, side):
        return x + jnp.tanh(jnp.tanh(x @ w["a"][0]) @ w["b"][0])  # [b, hidden] residuals per microbatch

    def head_fn(hp, y, loss_in):
        return jnp.sum(y * hp), jnp.asarray(1.0, jnp.float32)

    def temp_bytes(make, m):
        params = {"a": jnp.ones((p, 1, 1, d, hidden)), "b": jnp.ones((p, 1, 1, hidden, d))}
        fn = jax.jit(lambda params, x: run_schedule(make(p, m), stage_fn, head_fn, params, jnp.ones((d,)), x,
                                                    jnp.zeros((m, 1)), jnp.zeros((m, 1)), 1.0, mesh))
        compiled = fn.lower(params, jnp.ones((m, b, d))).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one = [temp_bytes(sch.one_f_one_b, m) for m in (8, 32)]
    gp = [temp_bytes(sch.gpipe, m) for m in (8, 32)]
    residual = b * hidden * 4  # one microbatch's [b, hidden] float32 residual
    assert gp[1] - gp[0] >= 24 * residual  # GPipe stashes every microbatch
    assert one[1] - one[0] < 2 * residual, (one, gp)  # 1F1B: 2p - 1 slots whatever m


def loop_collectives(hlo: str) -> dict[str, int]:
    """Collectives in the compiled while loops' bodies (and every computation they call), by kind."""
    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
        if head:
            name = head.group(1)
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name:
            comps[name].append(line)
    todo, seen = re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo), set()
    while todo:
        comp = todo.pop()
        if comp in seen or comp not in comps:
            continue
        seen.add(comp)
        for line in comps[comp]:
            todo += re.findall(r"(?:calls|to_apply|body|condition|\w+_computation)=%?([\w.\-]+)", line)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                todo += [ref.strip().lstrip("%") for ref in group.split(",")]
    kinds = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute")
    return {k: sum(bool(re.search(rf"\b{k}(-start)?\(", line)) for c in seen for line in comps[c]) for k in kinds}


def test_batch_split_reduces_gradients_once_per_step():
    """pipeline=2 x fsdp=2 with FSDP-sharded stage weights: with the batch axes manual (`BatchSplit`) the tick
    loop holds no gradient reduction or weight gather (one of each per step, outside it) and gives the same
    loss and gradients as leaving them to GSPMD, which reduces in every backward slot."""
    from jax.sharding import AxisType, Mesh, NamedSharding

    from mmjax.training.pipeline.executor import BatchSplit, run_schedule

    p, m, b, d, hidden = 2, 4, 4, 8, 16
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(1, 2, p, 1, 1), ("data", "fsdp", "pipeline", "sequence",
                                                                         "tensor"), axis_types=(AxisType.Auto,) * 5)
    P = jax.sharding.PartitionSpec
    spec = {"a": P("pipeline", None, None, "fsdp", None), "b": P("pipeline", None, None, None, "fsdp")}
    grads = {"a": P("pipeline", None, None, None, "fsdp"), "b": spec["b"]}  # a ZeRO-2-like split for one leaf
    keys = jax.random.split(jax.random.key(0), 3)
    params = {"a": jax.random.normal(keys[0], (p, 1, 1, d, hidden)),
              "b": jax.random.normal(keys[1], (p, 1, 1, hidden, d))}
    params = jax.device_put(params, {n: NamedSharding(mesh, s) for n, s in spec.items()})
    x = jax.random.normal(keys[2], (m, b, d))

    def stage_fn(w, x, side):
        return x + jnp.tanh(jnp.tanh(x @ w["a"][0]) @ w["b"][0])

    def head_fn(hp, y, loss_in):
        return jnp.sum(jnp.tanh(y) * hp), jnp.asarray(y.shape[0], jnp.float32)

    runs = {}
    for name, split in (("gspmd", None), ("split", BatchSplit(("fsdp",), spec, P(), grads, P()))):
        fn = jax.jit(lambda params, x, split=split: run_schedule(
            sch.one_f_one_b(p, m), stage_fn, head_fn, params, jnp.linspace(-1, 1, d), x, jnp.zeros((m, b)),
            jnp.zeros((m, b)), 1.0, mesh, split=split))
        compiled = fn.lower(params, x).compile()
        runs[name] = (jax.device_get(compiled(params, x)), loop_collectives(compiled.as_text()))
    (want, gspmd), (got, split) = runs["gspmd"], runs["split"]
    for a, b_ in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_err(np.asarray(a), np.asarray(b_)) <= 1e-5
    assert split["all-reduce"] == split["reduce-scatter"] == split["all-gather"] == 0, split
    assert split["collective-permute"] >= 2  # the pipeline's own sends stay in the loop
    assert gspmd["all-reduce"] + gspmd["reduce-scatter"] > 0, gspmd  # what the split takes out of the loop


def test_cli_pipeline_run_resumes_on_pipeline_1(tmp_path):
    """`python -m mmjax.train mesh.pipeline=2 mesh.fsdp=2 mesh.tensor=2` with uneven stages trains (with its
    end-of-run eval, which reads the params in canonical order through plain GSPMD); its checkpoint, written in
    canonical order, restores on pipeline=1 and back into the pipeline's stage-order storage exactly."""
    import orbax.checkpoint as ocp

    from mmjax.checkpoint.orbax_state import flat_leaves
    from mmjax.train import DEFAULT_CONFIG, main
    from mmjax.training.trainer import Trainer

    common = ["model.text.dim=64", "model.text.mlp_dim=128", "model.text.n_layers=3", "model.vision.dim=64",
              "model.vision.mlp_dim=128", "model.vision.n_layers=1", "data.num_train=128", "data.num_eval=8",
              "data.num_shards=2", "eval.num_examples=4", "eval.batch_size=4", "eval.max_new_tokens=2",
              "train.global_batch_size=8", "train.grad_accum_steps=2", "optim.warmup_steps=1",
              "observe.sinks=[jsonl]", "observe.log_every=1", f"data.cache_dir={tmp_path / 'cache'}"]
    run = tmp_path / "pp"
    assert main(common + ["mesh.data=1", "mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2", "train.steps=2",
                          f"train.output_dir={run}"]) == 0
    step_dir = run / "checkpoints" / "2"
    saved = jax.device_get(ocp.StandardCheckpointer().restore(step_dir.absolute() / "state"))
    cfg = load_config(DEFAULT_CONFIG, common + ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2", "train.steps=3",
                                                f"train.output_dir={tmp_path / 'p1'}", f"train.resume={step_dir}"])
    trainer = Trainer(cfg)
    a, b = flat_leaves(trainer.state), flat_leaves(saved)
    assert a.keys() == b.keys() and all(np.array_equal(np.asarray(jax.device_get(a[k])), np.asarray(b[k])) for k in a)
    # and back into the pipeline's stage-order storage (stages of 2 + 1 layers: a padding row on rank 1)
    cfg = load_config(DEFAULT_CONFIG, common + ["mesh.data=1", "mesh.pipeline=2", "mesh.fsdp=2", "mesh.tensor=2",
                                                "train.steps=3", f"train.output_dir={tmp_path / 'pp2'}",
                                                f"train.resume={step_dir}"])
    trainer = Trainer(cfg)
    assert trainer.setup.storage is not None and trainer.state.params["decoder"]["layers"]["attn_norm"]["scale"] \
        .sharding.spec[0] == "pipeline"
    a = flat_leaves(trainer.canonical.state_to_canonical(trainer.state))
    assert a.keys() == b.keys() and all(np.array_equal(np.asarray(jax.device_get(a[k])), np.asarray(b[k])) for k in a)
    losses = [r for r in map(__import__("json").loads, (run / "metrics.jsonl").read_text().splitlines())
              if "train/loss" in r]
    assert [r["step"] for r in losses] == [1, 2] and all(np.isfinite(r["train/loss"]) for r in losses)
