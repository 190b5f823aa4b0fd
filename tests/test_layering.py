"""The package layers import downward only (architecture: core <- engine/scheduling/pipeline
<- serve/cli <- models), no model package imports another, and the framework names no
model package at all (the registry finds models by architecture)."""

from __future__ import annotations

import ast
from pathlib import Path

import omnistage

ROOT = Path(omnistage.__file__).parent

# Rank of each top-level package: a module may import its own package and lower ranks only.
LAYERS: dict[str, int] = {
    "core": 0,
    "checkpoint": 1,
    "config": 1,
    "engine": 2,
    "scheduling": 3,
    "pipeline": 4,
    "serve": 5,
    "bench": 5,
    "cli": 6,
    "testing": 6,
    "models": 7,
}
MODEL_PACKAGES = sorted(p.name for p in (ROOT / "models").iterdir() if (p / "__init__.py").is_file())


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every omnistage import in ``path``, function-level ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = (
                [node.module]
                if node.module != "omnistage"
                else [f"omnistage.{a.name}" for a in node.names]
            )
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.split(".")[0] == "omnistage"]
    return found


def _modules() -> list[tuple[Path, tuple[str, ...]]]:
    return [(path, path.relative_to(ROOT).parts) for path in sorted(ROOT.rglob("*.py"))]


def test_every_package_has_a_layer():
    packages = {parts[0] for _, parts in _modules() if len(parts) > 1}
    assert packages <= LAYERS.keys(), (
        f"packages without a layer: {sorted(packages - LAYERS.keys())}"
    )
    stray = [
        str(path) for path, parts in _modules() if len(parts) == 1 and parts[0] != "__init__.py"
    ]
    assert not stray, f"modules outside every layer: {stray}"


def test_layers_import_downward_only():
    upward = []
    for path, parts in _modules():
        if len(parts) == 1:
            continue
        own = parts[0]
        for line, module in _imports(path):
            target = module.split(".")[1] if "." in module else ""
            if target != own and LAYERS.get(target, len(LAYERS)) >= LAYERS[own]:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} ({own}) imports {module}")
    assert not upward, "upward or sideways imports:\n" + "\n".join(upward)


def test_model_packages_do_not_import_each_other():
    crossing = []
    for path, parts in _modules():
        if parts[0] != "models" or len(parts) < 3:
            continue
        for line, module in _imports(path):
            names = module.split(".")
            if names[1] == "models" and len(names) > 2 and names[2] != parts[1]:
                crossing.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module}")
    assert not crossing, "\n".join(crossing)


def _named_model_packages(path: Path) -> list[str]:
    """``<line>: omnistage.models.<name>`` for each import of a model package in ``path`` and
    each string (an import path handed to importlib, a docstring) naming one."""
    texts = _imports(path) + [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]
    return [
        f"{line}: omnistage.models.{name}"
        for line, text in texts
        for name in MODEL_PACKAGES
        if f"omnistage.models.{name}" in text or f"omnistage/models/{name}" in text
    ]


def test_the_framework_names_no_model_package():
    """A new model family touches nothing outside its package: no framework module imports
    a model package or names one in a string."""
    named = [
        f"{path.relative_to(ROOT.parent)}:{hit}"
        for path, parts in _modules()
        if parts[0] != "models"
        for hit in _named_model_packages(path)
    ]
    assert not named, "framework modules name model packages:\n" + "\n".join(named)
