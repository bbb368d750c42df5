"""Inert placeholders for the heavy packages SGLang's import chain reaches on a CPU machine.

Importing SGLang's prefix caches (``sglang.srt.mem_cache``) pulls in modules that import
image, tokenizer, server and GPU-compiler packages at module level. No cache code path
uses them, and installing them (or their GPU wheels) is not possible or not sensible
here, so `install()` registers a placeholder module for each one that is not installed,
in this process only (an import hook; nothing is written to disk). A placeholder answers
any attribute with an inert class: it can be subclassed, used as a decorator target or a
type annotation, but calling it (or instantiating it) raises `PlaceholderCalled`, naming
what was called. So a benchmark that measured SGLang with a placeholder in a code path fails
loudly instead of measuring something else.

The few shapes the import chain needs beyond that (found the hard way) are spelled out
below, each with the reason.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from typing import Any

__all__ = ["PLACEHOLDERS", "PlaceholderCalled", "install"]

#: Top-level packages replaced by placeholders (with all their submodules).
PLACEHOLDERS = (
    "PIL",
    "aiohttp",
    "compressed_tensors",
    "gguf",
    "huggingface_hub",
    "openai",
    "partial_json_parser",
    "safetensors",
    "sentencepiece",
    "starlette",
    "torchvision",
    "tqdm",
    "transformers",
    "triton",
    "tvm_ffi",
    "zmq",
    "zstandard",
)

#: Submodules of triton that must look absent, so that torch does not take the
#: placeholder for a real triton install (torch probes these).
_ABSENT = {
    "triton.runtime",
    "triton.backends",
    "triton.compiler",
    "triton.testing",
    "triton.tools",
    "triton.knobs",
}


#: Registration hooks SGLang's model modules call at import time (``AutoProcessor.register``):
#: no-ops.
_HOOKS = {"register", "register_for_auto_class"}


class PlaceholderCalled(RuntimeError):
    """Code under measurement called into a placeholder package."""


def _inert(qualname: str) -> type:
    """Return a class standing for `qualname`: subclassable, never callable."""

    def new(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise PlaceholderCalled(f"placeholder {qualname} was called ({cls.__name__})")

    def getattr_(cls: type, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in _HOOKS:
            return _noop
        return _inert(f"{qualname}.{name}")

    def init_subclass(cls: type, **kwargs: Any) -> None:
        """Subclassing takes any class keywords (``class K(TypedDictLike, total=False)``)."""

    meta = type(f"{qualname}.meta", (type,), {"__getattr__": getattr_})

    def pydantic_schema(cls: type, source: Any, handler: Any) -> Any:
        """Request models name placeholder types in fields: validate them as anything."""
        from pydantic_core import core_schema

        return core_schema.any_schema()

    namespace = {
        "__new__": new,
        "__module__": qualname,
        "__init_subclass__": classmethod(init_subclass),
        "__get_pydantic_core_schema__": classmethod(pydantic_schema),
    }
    return meta(qualname.rsplit(".", 1)[-1], (), namespace)


class _Module(types.ModuleType):
    """A placeholder package.

    A capitalised attribute is an inert class, any other a placeholder submodule
    (``from transformers.utils import logging``); neither can be called.
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if name[:1].isupper():
            value: Any = _inert(full)
        elif full in _ABSENT:
            raise AttributeError(name)
        else:
            value = sys.modules.get(full) or _submodule(full)
        setattr(self, name, value)
        return value


def _submodule(full: str) -> _Module:
    mod = _Module(full)
    mod.__path__ = []  # type: ignore[attr-defined]
    sys.modules[full] = mod
    _special(mod)
    return mod


def _noop(*args: Any, **kwargs: Any) -> None:
    """Registration hooks called at import time: nothing to register."""


def _identity_decorator(*args: Any, **kwargs: Any) -> Any:
    """``@jit`` and ``@jit(...)`` alike: return the function unchanged."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda fn: fn


_CONFIG_MAPPING = type("ConfigMapping", (), {"_extra_content": {}, "register": _noop})()


def _special(mod: _Module) -> None:
    """Give placeholder `mod` the few real attributes the import chain needs."""
    name = mod.__name__
    if name == "triton":
        mod.__version__ = "3.0.0"  # type: ignore[attr-defined]
        for deco in ("jit", "autotune", "heuristics"):
            setattr(mod, deco, _identity_decorator)
        mod.Config = type("Config", (), {"__init__": _noop})  # type: ignore[attr-defined]
        mod.cdiv = lambda a, b: -(-a // b)  # type: ignore[attr-defined]
        mod.next_power_of_2 = lambda n: 1 << max(0, int(n) - 1).bit_length()  # type: ignore[attr-defined]
    elif name == "triton.language":
        mod.constexpr = type("constexpr", (), {"__init__": _noop})  # type: ignore[attr-defined]
        mod.jit = _identity_decorator  # type: ignore[attr-defined]
    elif name == "transformers.utils.logging":
        # Module-level loggers in SGLang's model configs: the standard library's.
        mod.get_logger = logging.getLogger  # type: ignore[attr-defined]
    elif name == "PIL":
        mod.UnidentifiedImageError = type("UnidentifiedImageError", (Exception,), {})  # type: ignore[attr-defined]
    if name == "transformers":
        # Subclassed at import time by pydantic-validated configs.
        mod.PretrainedConfig = type(  # type: ignore[attr-defined]
            "PretrainedConfig", (), {"__class_validators__": []}
        )
    if name in ("transformers", "transformers.models.auto.configuration_auto"):
        # Model configs register themselves in this mapping at import time.
        mod.CONFIG_MAPPING = _CONFIG_MAPPING  # type: ignore[attr-defined]


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, replaced: set[str]) -> None:
        self.replaced = replaced

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        top = fullname.split(".", 1)[0]
        if top not in self.replaced or fullname in _ABSENT:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> Any:
        mod = _Module(spec.name)
        mod.__path__ = []  # a package: submodules resolve through this finder too
        return mod

    def exec_module(self, module: Any) -> None:
        if module.__name__ == "PIL":
            module.Image = sys.modules.setdefault("PIL.Image", _Module("PIL.Image"))
        _special(module)


_installed = False


def install() -> None:
    """Register placeholders for the packages of `PLACEHOLDERS` that are not installed.

    An installed one (e.g. PIL under matplotlib) is used as it is. Also makes
    ``torch.compile`` an identity decorator (some SGLang modules compile functions at
    import time) and makes torch's probes for triton answer False. Idempotent.
    """
    global _installed
    if _installed:
        return
    _installed = True
    replaced = {
        name
        for name in PLACEHOLDERS
        if name not in sys.modules and importlib.util.find_spec(name) is None
    }
    sys.meta_path.insert(0, _Finder(replaced))
    import torch

    torch.compile = _identity_decorator  # type: ignore[assignment]
    try:
        import torch.utils._triton as tt

        for probe in ("has_triton", "has_triton_package"):
            if hasattr(tt, probe):
                f = getattr(tt, probe)
                if hasattr(f, "cache_clear"):
                    f.cache_clear()
                setattr(tt, probe, lambda: False)
    except ImportError:
        pass
