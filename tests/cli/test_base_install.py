"""The CLI must work on a base install (no extras): the README's serve command."""

import subprocess
import sys

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
