"""METHODS: decoding-method name -> factory(sampler, engine context, **options)."""
from __future__ import annotations

import importlib

METHODS: dict[str, tuple[str, str]] = {
    "ar": ("leapfrog.methods.autoregressive", "AutoregressiveMethod"),
}


def method_class(name: str) -> type:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    module, cls = METHODS[name]
    return getattr(importlib.import_module(module), cls)
