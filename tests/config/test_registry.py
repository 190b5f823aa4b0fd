"""Model discovery and resolution."""

import json

import pytest

from omnistage.models.piper.config import PiperVoiceConfig
from omnistage.models.piper.modeling import default_voice_path
from omnistage.serve.registry import ModelRegistry, RegistryError
from omnistage.testing.tone import ToneConfig


class LongTone(ToneConfig):
    """A variant: same model, longer admission queue."""

    @classmethod
    def for_model_path(cls, model_path):
        return super().for_model_path(model_path).model_copy(update={"max_concurrent_requests": 512})


def registry() -> ModelRegistry:
    reg = ModelRegistry.discover()
    reg.register(ToneConfig, {"long": LongTone})
    return reg


def test_discovery_finds_the_piper_voice_as_default():
    config = ModelRegistry.discover().resolve(None)
    assert isinstance(config, PiperVoiceConfig)
    assert config.model_path == str(default_voice_path())


def test_resolves_embedded_names_aliases_and_onnx_files():
    reg = registry()
    assert isinstance(reg.resolve("tone-test"), ToneConfig)
    assert isinstance(reg.resolve("tone"), ToneConfig)
    assert isinstance(reg.resolve(str(default_voice_path())), PiperVoiceConfig)


def test_resolves_a_checkpoint_dir_by_config_architectures(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["ToneGenerator"]}))
    assert isinstance(registry().resolve(str(tmp_path)), ToneConfig)


def test_unknown_architecture_lists_the_known_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Nope"]}))
    with pytest.raises(RegistryError, match="ToneGenerator"):
        registry().resolve(str(tmp_path))


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        registry().resolve(str(tmp_path / "missing"))


def test_duplicate_architecture_is_an_error():
    reg = registry()
    with pytest.raises(RegistryError, match="ToneGenerator"):
        reg.register(ToneConfig)


def test_named_variants():
    reg = registry()
    assert reg.resolve("tone-test", variant="long").max_concurrent_requests == 512
    with pytest.raises(RegistryError, match="variants: \\['long'\\]"):
        reg.resolve("tone-test", variant="short")


def _model_packages(tmp_path, monkeypatch, name: str, config_source: str) -> str:
    """A package ``name`` (unique per test: imports are cached) with one model package
    ``voice`` whose config.py is ``config_source``; returns ``name``."""
    root = tmp_path / name
    (root / "voice").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "voice" / "__init__.py").write_text("")
    (root / "voice" / "config.py").write_text(config_source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_model_whose_dependency_is_missing_is_unavailable_and_named_in_errors(tmp_path, monkeypatch):
    package = _model_packages(tmp_path, monkeypatch, "models_missing_dep", "import not_installed_backend_xyz\n")
    reg = ModelRegistry.discover((package,))
    assert reg.unavailable == {"voice": "needs the module 'not_installed_backend_xyz', which is not installed"}
    with pytest.raises(RegistryError, match="not_installed_backend_xyz"):
        reg.resolve(None)


def test_a_model_package_that_fails_to_import_otherwise_is_an_error(tmp_path, monkeypatch):
    package = _model_packages(tmp_path, monkeypatch, "models_broken", "raise ImportError('broken on purpose')\n")
    with pytest.raises(RegistryError, match="broken on purpose"):
        ModelRegistry.discover((package,))
