"""Model registry: discovers model packages and picks one for a ``--model-path``.

Every package under ``omnistage.models`` whose ``config`` module exposes ``EntryClass``
(a :class:`~omnistage.serve.model.ModelConfig` subclass: a speech or a chat model) is registered under its ``architecture`` and
``aliases``; ``Variants`` adds named variants. A duplicate architecture is an error.

Models outside ``omnistage.models``: ``OMNISTAGE_EXTRA_MODELS`` holds comma-separated
entries, each either a package of model packages laid out like ``omnistage.models``
(``tests.extra_models``: each sub-package's ``config.EntryClass``) or one class
(``package.module:Class``), registered after the discovered ones.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path

from omnistage.serve.model import ChatModelConfig, ModelConfig, SpeechModelConfig

logger = logging.getLogger(__name__)

EXTRA_MODELS_ENV = "OMNISTAGE_EXTRA_MODELS"


class RegistryError(ValueError):
    """A model cannot be registered or resolved; the message says what is known."""


class UnknownVariantError(RegistryError):
    """The model exists but has no variant of that name."""


class UnsupportedLoadFormatError(RegistryError):
    """The model does not take the requested load format."""


@dataclass
class ModelEntry:
    entry: type[ModelConfig]
    variants: dict[str, type[ModelConfig]] = field(default_factory=dict)


class ModelRegistry:
    """Architectures -> model entries."""

    def __init__(self) -> None:
        self.entries: dict[str, ModelEntry] = {}
        self._names: dict[str, str] = {}  # architecture or alias -> architecture
        # model package -> why it is unavailable (a third-party dependency is not installed)
        self.unavailable: dict[str, str] = {}

    @classmethod
    def discover(
        cls, packages: tuple[str, ...] = ("omnistage.models",), extra: str | None = None
    ) -> ModelRegistry:
        """Import ``<package>.<model>.config`` for every sub-package and register it, then
        the ``extra`` entries (default: ``$OMNISTAGE_EXTRA_MODELS``; module docstring).

        A package whose third-party dependency is not installed (e.g. ``piper`` on a
        GPU-only install) is not registered: it is listed in :attr:`unavailable` with the
        missing module, logged, and named in the error of a request that needs a model
        nobody else serves. Any other import failure is a bug and raises.

        Raises:
            RegistryError: a model package fails to import for another reason, or an extra
                entry cannot be imported, is not a model class, or clashes with a
                registered model.
        """
        registry = cls()
        extra = os.environ.get(EXTRA_MODELS_ENV, "") if extra is None else extra
        classes = [e.strip() for e in extra.split(",") if ":" in e]
        packages = (*packages, *(e.strip() for e in extra.split(",") if e.strip() and ":" not in e))
        for package_name in packages:
            try:
                package = importlib.import_module(package_name)
            except ImportError as exc:
                raise RegistryError(f"{EXTRA_MODELS_ENV} entry {package_name!r}: cannot import it: {exc}") from None
            for info in pkgutil.iter_modules(package.__path__):
                if not info.ispkg:
                    continue
                module_name = f"{package_name}.{info.name}.config"
                try:
                    module = importlib.import_module(module_name)
                except ImportError as exc:
                    if isinstance(exc, ModuleNotFoundError) and exc.name == module_name:
                        continue
                    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
                    if missing and missing.split(".")[0] not in ("omnistage", package_name.split(".")[0]):
                        registry.unavailable[info.name] = f"needs the module {missing!r}, which is not installed"
                        logger.warning("model package %s is unavailable: %s", module_name, registry.unavailable[info.name])
                        continue
                    raise RegistryError(f"model package {module_name} cannot be imported: {exc}") from exc
                entry = getattr(module, "EntryClass", None)
                if entry is not None:
                    registry.register(entry, getattr(module, "Variants", {}))
        for dotted in classes:
            registry.register(_import_model_class(dotted))
        return registry

    def register(self, entry: type[ModelConfig], variants: dict[str, type[ModelConfig]] | None = None) -> None:
        """Raises: RegistryError on a duplicate architecture, alias or embedded name, or a
        second default model."""
        if entry.is_default:
            if not entry.embedded_models:
                raise RegistryError(f"{entry.architecture} is marked default but embeds no model")
            for other in self.entries.values():
                if other.entry.is_default:
                    raise RegistryError(
                        f"both {other.entry.architecture} and {entry.architecture} are marked default"
                    )
        for name in (entry.architecture, *entry.aliases, *entry.embedded_models):
            if name in self._names:
                raise RegistryError(
                    f"{name!r} is claimed by both {self._names[name]} and {entry.architecture}"
                )
            self._names[name] = entry.architecture
        self.entries[entry.architecture] = ModelEntry(entry, dict(variants or {}))

    def known(self) -> list[str]:
        return sorted(self._names)

    def resolve(
        self, model_path: str | None, variant: str | None = None, load_format: str | None = None
    ) -> ModelConfig:
        """The default pipeline config for ``model_path`` (None: the default embedded model).

        Args:
            load_format: passed to the model's ``for_model_path`` (None: its default).

        Raises:
            RegistryError: unknown architecture/name/variant (listing the known ones).
            UnsupportedLoadFormatError: the model does not take ``load_format``.
            FileNotFoundError: the path does not exist.
        """
        entry = self._entry_for(model_path)
        cls = entry.entry
        if variant is not None:
            if variant not in entry.variants:
                raise UnknownVariantError(
                    f"{cls.architecture} has no variant {variant!r}; variants: {sorted(entry.variants) or 'none'}"
                )
            cls = entry.variants[variant]
        if model_path is None or model_path in (cls.architecture, *cls.aliases):
            if not cls.embedded_models:
                raise RegistryError(f"{cls.architecture} embeds no model: pass a checkpoint path")
            model_path = cls.embedded_models[0]
        if load_format is None:
            return cls.for_model_path(model_path)
        if load_format not in cls.load_formats:
            raise UnsupportedLoadFormatError(
                f"{cls.architecture} does not take load format {load_format!r}; it loads its "
                f"checkpoint only{' or: ' + ', '.join(cls.load_formats) if cls.load_formats else ''}"
            )
        return cls.for_model_path(model_path, load_format=load_format)

    def _entry_for(self, model_path: str | None) -> ModelEntry:
        if model_path is None:
            defaults = [e for e in self.entries.values() if e.entry.is_default]
            if not defaults:
                raise RegistryError(f"no default model is registered{self._unavailable_note()}; pass --model-path")
            return defaults[0]
        if model_path in self._names:
            return self.entries[self._names[model_path]]
        path = Path(model_path)
        if not path.exists():
            raise FileNotFoundError(
                f"model path {model_path!r} does not exist and is not a registered model name "
                f"({', '.join(self.known())})"
            )
        for entry in self.entries.values():
            if entry.entry.claims(path):
                return entry
        config_file = path / "config.json"
        if not config_file.is_file():
            raise RegistryError(f"{model_path!r} has no config.json and no registered model claims it")
        architectures = json.loads(config_file.read_text()).get("architectures") or []
        for name in architectures:
            if name in self._names:
                return self.entries[self._names[name]]
        raise RegistryError(
            f"{model_path!r}: architectures {architectures} are not supported; known: "
            f"{', '.join(self.known())}{self._unavailable_note()}"
        )

    def _unavailable_note(self) -> str:
        if not self.unavailable:
            return ""
        return " (unavailable model packages: " + "; ".join(f"{k} {v}" for k, v in sorted(self.unavailable.items())) + ")"


def _import_model_class(dotted: str) -> type[ModelConfig]:
    module_name, _, attr = dotted.partition(":")
    where = f"{EXTRA_MODELS_ENV} entry {dotted!r}"
    if not module_name or not attr:
        raise RegistryError(f"{where} is not a dotted path like 'package.module:Class'")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise RegistryError(f"{where}: cannot import {module_name!r}: {exc}") from None
    except AttributeError:
        raise RegistryError(f"{where}: module {module_name!r} has no {attr!r}") from None
    if not (isinstance(cls, type) and issubclass(cls, SpeechModelConfig | ChatModelConfig)):
        raise RegistryError(f"{where} is not a SpeechModelConfig subclass (nor a ChatModelConfig one)")
    return cls
