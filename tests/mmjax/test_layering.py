"""Import layering of the library, checked on the source (AST), so a violating import fails here even when
it sits inside a function: kernels import nothing else of mmjax, parallel never imports the model, and the
library never imports the command-line `tools`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mmjax"


def imported_modules(path: Path, package_root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, absolute name) of every import in `path`, relative ones resolved, nested ones included.

    `from a import b` yields `a.b` (b a submodule or a name in a), so `from mmjax import config` is
    `mmjax.config` and `from mmjax import kernels` is `mmjax.kernels`."""
    package = list(path.relative_to(package_root.parent).parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            out += [(node.lineno, base if alias.name == "*" else f"{base}.{alias.name}") for alias in node.names]
    return out


def violations(folder: str, forbidden, package_root: Path = PACKAGE) -> list[str]:
    """'file:line module' for each import under `package_root/folder` that `forbidden(module)` rejects."""
    root = package_root / folder if folder else package_root
    return [f"{path.relative_to(package_root.parent)}:{line} imports {module}"
            for path in sorted(root.rglob("*.py")) for line, module in imported_modules(path, package_root)
            if forbidden(module)]


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _outside_kernels(module: str) -> bool:
    return _within(module, "mmjax") and not _within(module, "mmjax.kernels")


RULES = {
    "kernels import only mmjax.kernels": ("kernels", _outside_kernels),
    "parallel does not import the model": ("parallel", lambda m: _within(m, "mmjax.model")),
    "the library does not import tools": ("", lambda m: _within(m, "tools")),
}


@pytest.mark.parametrize("rule", RULES)
def test_layering(rule):
    folder, forbidden = RULES[rule]
    assert violations(folder, forbidden) == []


KERNELS, PARALLEL, TOOLS = RULES  # rule names


@pytest.mark.parametrize("probe, source, rule, bad", [
    ("kernels/attention/probe.py", "from mmjax.config import Config\n", KERNELS, True),
    ("kernels/attention/probe.py", "def f():\n    from ...engine import steps\n", KERNELS, True),
    ("kernels/attention/probe.py", "def f():\n    from ... import config\n", KERNELS, True),
    ("kernels/probe.py", "import mmjax.observe.flops\n", KERNELS, True),
    ("kernels/probe.py", "import mmjax\n", KERNELS, True),
    ("kernels/attention/probe.py", "from mmjax import kernels\nfrom .. import _dispatch\n"
     "from .reference import make_mask\nfrom mmjax.kernels.attention import OP\n", KERNELS, False),
    ("parallel/probe.py", "def f():\n    import mmjax.model.layers\n", PARALLEL, True),
    ("parallel/probe.py", "from ..model import MLLM\n", PARALLEL, True),
    ("parallel/probe.py", "from mmjax import model\n", PARALLEL, True),
    ("parallel/probe.py", "from mmjax.kernels import attention\nfrom .rules import spec_axes\n", PARALLEL, False),
    ("engine/probe.py", "import tools.bench_train\n", TOOLS, True),
    ("probe.py", "def main():\n    from tools import bench_kernels\n", TOOLS, True),
])
def test_layering_catches_added_imports(tmp_path, probe, source, rule, bad):
    """A file with `source` added to a copy-shaped package is flagged exactly when it breaks `rule`."""
    folder, forbidden = RULES[rule]
    target = tmp_path / "mmjax" / probe
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(source)
    found = violations(folder, forbidden, tmp_path / "mmjax")
    assert bool(found) == bad, found
