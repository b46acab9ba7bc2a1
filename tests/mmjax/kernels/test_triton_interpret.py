"""The native Triton bias+GELU kernels under Triton's CPU interpreter (TRITON_INTERPRET=1), vs the reference.

jax-triton itself needs a GPU, so on CPU the kernels' *Triton source* is checked through the interpreter
with torch CPU tensors, in a subprocess (the variable must be set before triton loads). Skipped where
triton or torch is not installed (the CI image has neither: they are GPU extras).
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
    reason="triton/torch not installed (GPU extras); the jax-triton path is covered by `pytest -m gpu`")

SCRIPT = r"""
import numpy as np, torch, jax, jax.numpy as jnp
from mmjax.kernels.bias_gelu import HASH_K0, HASH_K1, HASH_K2, bias_gelu_reference
from mmjax.kernels.bias_gelu.pallas import TILING, tiles
from mmjax.kernels.bias_gelu.triton_src import bias_gelu_bwd, bias_gelu_fwd
TILES_PER_PROGRAM = TILING.tiles_per_program
n, c = 148, 40  # 37 row tiles of 4: three backward programs, the last walking 5 tiles
r, bc, cp = tiles(n, c)
n_tiles = n // r
programs = -(-n_tiles // TILES_PER_PROGRAM)
assert programs == 3, (r, programs)
rng = np.random.default_rng(0)
x, g = (rng.standard_normal((n, c)).astype(np.float32) for _ in range(2))
b = rng.standard_normal(c).astype(np.float32)
for rate in (0.0, 0.3):
    for approx in (False, True):
        meta = dict(C=c, R=r, BC=bc, APPROX=approx, RATE=rate, THRESH=int(rate * (1 << 24)), K0=HASH_K0, K1=HASH_K1,
                    K2=HASH_K2)
        y, dx, db = torch.zeros(n, c), torch.zeros(n, c), torch.zeros(programs, c)
        s = torch.full((16,), 7, dtype=torch.int32)
        bias_gelu_fwd[(n // r, cp // bc)](torch.tensor(x), torch.tensor(b), s, y, **meta)
        bias_gelu_bwd[(programs, cp // bc)](torch.tensor(x), torch.tensor(b), s, torch.tensor(g), dx, db,
                                            N_TILES=n_tiles, TILES=TILES_PER_PROGRAM, STAGES=TILING.bwd_stages,
                                            **meta)
        want, vjp = jax.vjp(lambda x, b: bias_gelu_reference(x, b, approximate=approx, dropout_rate=rate, seed=7),
                            jnp.asarray(x), jnp.asarray(b))
        gx, gb = vjp(jnp.asarray(g))
        np.testing.assert_allclose(y.numpy(), np.asarray(want), atol=1e-5)
        np.testing.assert_allclose(dx.numpy(), np.asarray(gx), atol=1e-5)
        np.testing.assert_allclose(db.numpy().sum(0), np.asarray(gb), atol=1e-4)
print("ok")
"""


def test_triton_source_matches_reference_in_interpreter():
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
