"""The CLI must work on a base install (no extras): the README's serve command."""

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[2]  # the checkout: pyproject.toml and omnistage/

BLOCK_EXTRAS = """
import sys
for name in ("pocketsphinx", "matplotlib", "openai", "hypothesis", "pytest"):
    sys.modules[name] = None  # as if not installed
from omnistage.cli.main import app
app(["--help"], prog_name="omnistage", standalone_mode=False)
app(["bench", "wer", "--help"], prog_name="omnistage", standalone_mode=False)
"""


def test_cli_imports_without_the_optional_extras():
    result = subprocess.run([sys.executable, "-c", BLOCK_EXTRAS], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout and "--asr" in result.stdout


# Imported at module level by omnistage, yet rightly not a base dependency of its own:
# import name -> the requirement that installs it.
PROVIDED_BY = {
    "click": "typer",
    "pydantic_core": "pydantic",
    "starlette": "fastapi",
    "triton": "torch",  # its CUDA builds; the Triton kernels are imported only on CUDA
    "ray": "omnistage[ray]",  # placement: ray only (docs/ray.md)
}


def _requirement_name(requirement: str) -> str:
    """``"piper-tts>=1.8"`` -> ``"piper-tts"`` (PEP 503 normalized)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def _module_level_imports() -> dict[str, set[str]]:
    """Top-level name of every non-stdlib module omnistage imports at module level (what
    importing that module needs installed) -> the files importing it."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "omnistage").rglob("*.py")):
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "omnistage":
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_module_level_import_is_a_declared_dependency():
    """A base install (the README's serve command) has every package omnistage's modules
    import: a missing one (Pillow, once) kills the media decoder workers at start."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {_requirement_name(r) for r in project["dependencies"]}
    extras = {
        f"omnistage[{k}]": {_requirement_name(r) for r in v}
        for k, v in project["optional-dependencies"].items()
    }
    distributions = importlib.metadata.packages_distributions()
    undeclared = []
    for module, files in sorted(_module_level_imports().items()):
        if module in PROVIDED_BY:
            provider = PROVIDED_BY[module]
            assert provider in base or module in extras.get(provider, ()), (module, provider)
            continue
        names = {_requirement_name(d) for d in distributions.get(module, [])}
        assert names, f"{module} (imported by {sorted(files)}) is not installed here"
        if not names & base:
            importers = ", ".join(sorted(files))
            undeclared.append(f"{module} ({'/'.join(sorted(names))}; imported by {importers})")
    assert not undeclared, "not in pyproject.toml's dependencies: " + "; ".join(undeclared)
