"""Save and load a pre-quantized serving model: `config.yaml`, `weights.npz` and `quant.json` in one folder.

The state is stored as served (int8 / e4m3 / int4 values with their scales), so loading needs neither the float
checkpoint nor the conversion. e4m3 values are stored as their uint8 bit patterns, packed int4 as its int8 bytes
and unpacked int4 as one int8 per value (numpy has no such dtypes); a quantized embedding table as its int8
[embed, vocab] output matmul; `quant.json` records each quantized parameter's scheme and layout and the image
token id.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.config import Config, load_config, to_yaml
from mmjax.errors import CheckpointError
from mmjax.model import MLLM
from mmjax.quant.apply import param_name as _name
from mmjax.quant.table import QuantizedTable
from mmjax.quant.weights import FP8, QuantizedWeight

FILES = ("config.yaml", "weights.npz", "quant.json")


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _to_numpy(x: jax.Array) -> np.ndarray:
    if x.dtype == FP8:
        return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8))
    if x.dtype == jnp.int4:
        return np.asarray(x.astype(jnp.int8))
    return np.asarray(x)


def save_quantized(folder: str | os.PathLike, cfg: Config, model: Any) -> Path:
    """Write `model`'s parameters (quantized where they are) and `cfg` into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    layout: dict[str, Any] = {}
    for path, var in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param), is_leaf=_is_var)[0]:
        name, value = _name(path), var[...]
        table = isinstance(value, QuantizedTable)
        value = value.head if table else value
        if isinstance(value, QuantizedWeight):
            arrays[f"{name}/q"], arrays[f"{name}/scale"] = _to_numpy(value.q), np.asarray(value.scale)
            layout[name] = dict(scheme=value.scheme, n_contract=value.n_contract, n_out=value.n_out,
                                group=value.group, act_fp8=value.act_fp8, contract_shape=list(value.contract_shape),
                                transposed=value.transposed, table=table)
        else:
            arrays[name] = _to_numpy(value)
    np.savez(folder / "weights.npz", **arrays)
    (folder / "config.yaml").write_text(to_yaml(cfg))
    (folder / "quant.json").write_text(json.dumps(dict(image_token_id=int(model.image_token_id), quantized=layout),
                                                  indent=1))
    return folder


def load_quantized(folder: str | os.PathLike, overrides: tuple[str, ...] = ()) -> tuple[Config, Any]:
    """(config, MLLM) of a folder `save_quantized` wrote; the model holds the stored (quantized) weights."""

    folder = Path(folder)
    missing = [f for f in FILES if not (folder / f).is_file()]
    if missing:
        raise CheckpointError(f"{folder} is not a pre-quantized model folder (missing {missing}); write one with "
                              "python -m mmjax.tools.eval_quant --save-quantized")
    cfg = load_config(folder / "config.yaml", list(overrides))
    meta = json.loads((folder / "quant.json").read_text())
    layout = meta["quantized"]
    arrays = np.load(folder / "weights.npz")
    model = nnx.eval_shape(lambda: MLLM(cfg.model, image_token_id=meta["image_token_id"], rngs=nnx.Rngs(0)))

    def fill(path, var):
        if not _is_var(var):
            return var
        name = _name(path)
        if name in layout:
            lay = {**layout[name], "contract_shape": tuple(layout[name].get("contract_shape", ()))}
            table = lay.pop("table", False)
            q = jnp.asarray(arrays[f"{name}/q"])
            q = jax.lax.bitcast_convert_type(q, FP8) if lay["scheme"] == "fp8" else q
            q = q.astype(jnp.int4) if lay["scheme"] == "int4" and not lay["contract_shape"] else q
            value = QuantizedWeight(q, jnp.asarray(arrays[f"{name}/scale"]), **lay)
            return var.replace(value=QuantizedTable(value) if table else value)
        if name not in arrays:
            raise CheckpointError(f"{folder}: weights.npz lacks {name}, which the model config needs")
        return var.replace(value=jnp.asarray(arrays[name], var.get_value().dtype))

    nnx.update(model, jax.tree_util.tree_map_with_path(fill, nnx.state(model, nnx.Param), is_leaf=_is_var))
    return cfg, model
