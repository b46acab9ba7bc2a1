"""Import layering of the library, checked on the source (AST), so a violating import fails here even when it
sits inside a function.

The packages form layers (docs/architecture.md draws them): each may import only the packages listed for it in
`ALLOWED`; `config` imports nothing of mmjax but `errors`; kernels import only kernels; the command-line `tools`
and entry points may import anything and nothing imports them. The module graph has no cycle, and an import
inside a library function is allowed only with a comment saying why (an optional dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mmjax"

ENTRY_POINTS = {"train", "serve", "generate", "tools", "__main__"}  # may import anything
BASE = {"errors"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "config": BASE,
    "kernels": set(),
    "data": BASE | {"config"},
    "observe": BASE | {"config"},
    "parallel": BASE | {"config", "kernels"},
    "model": BASE | {"config", "kernels", "parallel"},
    "quant": BASE | {"config", "kernels", "model"},
    "checkpoint": BASE | {"config", "kernels", "parallel", "model", "data", "observe", "quant"},
    "serving": BASE | {"config", "kernels", "parallel", "model", "data", "observe", "quant", "checkpoint"},
    "training": BASE | {"config", "kernels", "parallel", "model", "data", "observe", "quant", "checkpoint",
                        "serving"},
    "bench": BASE | {"config", "kernels", "parallel", "model", "data", "observe", "quant", "checkpoint",
                     "serving", "training"},
    "__init__": BASE,  # mmjax/__init__.py
}


def module_name(path: Path, package_root: Path) -> str:
    parts = list(path.relative_to(package_root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, package_root: Path = PACKAGE) -> list[tuple[int, str, bool]]:
    """(line, absolute module name, nested in a function) of every mmjax import in `path`, relative ones
    resolved. `from a import b` yields `a.b` (b a submodule or a name in a)."""
    package = list(path.relative_to(package_root.parent).parts[:-1])
    tree = ast.parse(path.read_text(), str(path))
    nested_ids = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names = [base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        out += [(node.lineno, n, id(node) in nested_ids) for n in names if n == "mmjax" or n.startswith("mmjax.")]
    return out


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_violations(package_root: Path = PACKAGE) -> list[str]:
    """'file:line imports module (package a may not import package b)' for every import against `ALLOWED`."""
    out = []
    for path in sorted(package_root.rglob("*.py")):
        me = package_of(module_name(path, package_root))
        if me in ENTRY_POINTS:
            continue
        for line, module, _ in imports(path, package_root):
            other = package_of(module)
            if other in ENTRY_POINTS and other != "__init__" or (other != me and other not in ALLOWED.get(me, set())):
                out.append(f"{path.relative_to(package_root.parent)}:{line} imports {module} "
                           f"({me} may not import {other})")
    return out


def unexplained_nested_imports(package_root: Path = PACKAGE) -> list[str]:
    """Imports of mmjax inside a function without a comment (same line or above its block) saying why. The
    entry points (`python -m mmjax.train/serve/generate`, tools) import the library after parsing arguments and
    setting up logging and the backend's flags, by design: they are exempt."""
    out = []
    for path in sorted(package_root.rglob("*.py")):
        if package_of(module_name(path, package_root)) in ENTRY_POINTS:
            continue
        lines = path.read_text().splitlines()
        for line, module, nested in imports(path, package_root):
            if not nested:
                continue
            first = line - 1  # the comment may sit above the block of imports this one belongs to
            while first > 0 and lines[first - 1].strip().startswith(("from ", "import ")):
                first -= 1
            block = lines[first:line]
            if not any("#" in text for text in block) and not (first and lines[first - 1].strip().startswith("#")):
                out.append(f"{path.relative_to(package_root.parent)}:{line} imports {module} inside a function")
    return out


def module_cycles(package_root: Path = PACKAGE) -> list[list[str]]:
    """Cycles among the modules' top-level imports (a module importing its own package's __init__ excluded:
    Python runs the package first)."""
    modules = {module_name(p, package_root): p for p in package_root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for _, module, nested in imports(path, package_root):
            if nested:
                continue
            target = module if module in modules else module.rsplit(".", 1)[0]
            if target in modules and target != name and not name.startswith(target + "."):
                deps.add(target)
        graph[name] = deps
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_packages_import_only_lower_layers():
    assert layer_violations() == []


def test_config_imports_only_errors():
    assert ALLOWED["config"] == {"errors"}
    assert [m for _, m, _ in imports(PACKAGE / "config.py") if package_of(m) != "errors"] == []


def test_no_module_cycle():
    assert module_cycles() == []


def test_nested_imports_say_why():
    assert unexplained_nested_imports() == []


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "mmjax"
    for rel, source in files.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source)
    return root


@pytest.mark.parametrize("probe, source, bad", [
    ("kernels/attention/probe.py", "from mmjax.config import Config\n", True),
    ("kernels/attention/probe.py", "def f():\n    from ...training import steps  # why\n", True),
    ("kernels/probe.py", "import mmjax.observe.flops\n", True),
    ("kernels/attention/probe.py", "from mmjax import kernels\nfrom .. import _dispatch\n", False),
    ("config.py", "from mmjax import kernels\n", True),
    ("config.py", "def f():\n    from mmjax.training.pipeline import plan  # local\n", True),
    ("config.py", "from mmjax.errors import ConfigError\n", False),
    ("parallel/probe.py", "from ..model import MLLM\n", True),
    ("parallel/probe.py", "from mmjax.kernels import attention\nfrom .rules import spec_axes\n", False),
    ("serving/probe.py", "from mmjax.training.trainer import Trainer\n", True),
    ("checkpoint/probe.py", "from mmjax.serving.engine import Engine\n", True),
    ("serving/probe.py", "from mmjax.checkpoint.convert import load_params\n", False),
    ("training/probe.py", "from mmjax.serving.engine import Engine\n", False),
    ("training/probe.py", "from mmjax.bench.train import synthetic_batch\n", True),
    ("data/probe.py", "def main():\n    from mmjax.tools import bench_kernels  # why\n", True),
    ("tools/probe.py", "from mmjax.bench import kernels\nfrom mmjax.training import trainer\n", False),
])
def test_layer_rule_catches_planted_import(tmp_path, probe, source, bad):
    """A file with `source` planted in a copy-shaped package is flagged exactly when it breaks the layering."""
    found = layer_violations(_plant(tmp_path, {probe: source}))
    assert bool(found) == bad, found


def test_cycle_check_catches_planted_cycle(tmp_path):
    root = _plant(tmp_path, {"training/a.py": "from mmjax.training import b\n",
                             "training/b.py": "from mmjax.training.a import x\n"})
    assert module_cycles(root) == [["mmjax.training.a", "mmjax.training.b", "mmjax.training.a"]]
    root = _plant(tmp_path / "ok", {"training/a.py": "from mmjax.training import b\n", "training/b.py": "x = 1\n"})
    assert module_cycles(root) == []


def test_nested_import_check_catches_unexplained_import(tmp_path):
    root = _plant(tmp_path, {"serving/a.py": "def f():\n    from mmjax.model import MLLM\n",
                             "serving/b.py": "def f():\n    from mmjax.model import MLLM  # optional torch peer\n"})
    assert unexplained_nested_imports(root) == ["mmjax/serving/a.py:2 imports mmjax.model.MLLM inside a function"]
