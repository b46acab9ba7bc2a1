import jax
import pytest
from jax.sharding import PartitionSpec as P

from mmjax.config import PACKAGED_CONFIGS, load_config
from mmjax.errors import ConfigError
from mmjax.parallel.mesh import make_mesh, resolve_mesh_shape
from mmjax.parallel.rules import logical_to_spec, rules_from_config
from mmjax.training.init import model_setup


def test_minus_one_takes_the_remaining_devices():
    cfg = load_config(None, ["mesh.data=-1", "mesh.tensor=2"])
    assert resolve_mesh_shape(cfg.mesh, 8) == {"data": 4, "fsdp": 1, "pipeline": 1, "sequence": 1, "tensor": 2}


@pytest.mark.parametrize("overrides, message", [
    (["mesh.data=3"], "multiply to 3 but 8 devices"),
    (["mesh.data=-1", "mesh.tensor=3"], "no integer size"),
    (["mesh.data=1", "mesh.tensor=8"], "model.text.n_kv_heads=2 is not divisible by mesh.tensor=8"),
    (["mesh.data=8", "train.global_batch_size=12"], "data-parallel size"),
])
def test_mesh_errors_name_the_problem(overrides, message):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=message):
        make_mesh(cfg)


def test_logical_rules_to_partition_specs():
    assert logical_to_spec(("embed", "kv_heads", None, "head_dim")) == P("fsdp", "tensor", None, None)
    assert logical_to_spec(("layers", "mlp", "embed")) == P(None, "tensor", "fsdp")
    assert logical_to_spec(("batch", "length")) == P(("data", "fsdp"), "sequence")
    assert logical_to_spec(()) == P()


def test_rules_from_config_switches_and_overrides():
    cfg = load_config(None, ["parallel.sequence_parallel=true", "parallel.rules={vocab: null, mlp: [tensor, fsdp]}"])
    rules = rules_from_config(cfg)
    assert (logical_to_spec(("batch", "norm_length", "act_embed"), rules)
            == P(("data", "fsdp"), ("sequence", "tensor"), None))
    assert logical_to_spec(("vocab", "embed"), rules) == P(None, "fsdp")
    assert logical_to_spec(("embed", "mlp"), rules) == P("fsdp", "tensor")  # fsdp already used by embed
    zero1 = rules_from_config(load_config(None, ["parallel.zero_stage=1"]))
    assert logical_to_spec(("embed", "mlp"), zero1) == P(None, "tensor")
    assert logical_to_spec(("batch",), zero1) == P(("data", "fsdp"))


@pytest.mark.parametrize("overrides, message", [
    (["parallel.rules={embed: fdsp}"], "parallel.rules.embed"),
    (["parallel.zero_stage=4"], "zero_stage"),
    (["parallel.context_parallel=ulysses"], "context_parallel"),
])
def test_bad_parallel_config_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_layout_presets_load_and_fit_eight_devices():
    presets = sorted((PACKAGED_CONFIGS / "parallel").glob("*.yaml"))
    assert {p.stem for p in presets} >= {"fsdp", "fsdp_tp", "tp_sp", "context_parallel", "hybrid_dp_fsdp"}
    for preset in presets:
        cfg = load_config(["mmjax/configs/tiny_shapes.yaml", preset], [])
        if cfg.mesh.pipeline == 1:
            assert make_mesh(cfg).devices.size == 8, preset


def test_params_are_created_sharded_over_fsdp_and_tensor():
    cfg = load_config(None, ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2", "model.compute_dtype=float32"])
    mesh = make_mesh(cfg)
    setup = model_setup(cfg, mesh, image_token_id=3)
    params = setup.make_params()
    leaves = jax.tree.leaves(params)
    assert leaves
    # every parameter of rank >= 3 (stacked matrices) is split across devices
    assert all(x.addressable_shards[0].data.size < x.size for x in leaves if x.ndim >= 3)
    emb = params["decoder"]["embedding"]
    assert emb.addressable_shards[0].data.shape == (cfg.model.vocab_size // 2, cfg.model.text.dim // 4)
    total = sum(x.size for x in leaves)
    per_device = sum(x.addressable_shards[0].data.size for x in leaves)
    assert per_device < total / 4


def test_dcn_axes_need_as_many_processes():
    cfg = load_config(None, ["mesh.data=2", "mesh.dcn_data=2", "mesh.fsdp=4"])
    with pytest.raises(ConfigError, match="1 processes"):
        make_mesh(cfg)
    with pytest.raises(ConfigError, match="does not divide"):
        make_mesh(load_config(None, ["mesh.data=2", "mesh.dcn_data=4", "mesh.fsdp=4"]))
