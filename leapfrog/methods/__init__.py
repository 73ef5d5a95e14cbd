"""METHODS: decoding-method name -> factory(sampler, engine context, **options).

The registry names each method's module without importing it, and default_method imports what
it reads inside the call: the commands' flag parsing asks for the default method without
loading torch or any method."""
from __future__ import annotations

import importlib
from pathlib import Path

METHODS: dict[str, tuple[str, str]] = {
    "ar": ("leapfrog.methods.autoregressive", "AutoregressiveMethod"),
    "dflash": ("leapfrog.methods.drafters", "DFlashMethod"),
    "dspark": ("leapfrog.methods.drafters", "DSparkMethod"),
    "diffusion": ("leapfrog.methods.diffusion", "DiffusionMethod"),
    "draft": ("leapfrog.methods.draft_model", "DraftModelMethod"),
    "ngram": ("leapfrog.methods.ngram", "NgramMethod"),
}


def method_class(name: str) -> type:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    module, cls = METHODS[name]
    return getattr(importlib.import_module(module), cls)


def draft_model_check(method: str, draft_model: str | None) -> None:
    """A ValueError naming draft_model when `method` reads none (Method.reads_draft_model)."""
    if draft_model and not method_class(method).reads_draft_model:
        readers = [n for n in METHODS if method_class(n).reads_draft_model]
        raise ValueError(f"draft_model={draft_model!r}: method {method!r} reads no draft model (those that do: "
                         f"{', '.join(readers)})")


def default_method(model: str) -> str:
    """The best lossless method a model supports out of the box: a model folder that ships a
    drafter (a `drafter/` subfolder or `leapfrog.json` naming one) gets its speculative
    method; every other model decodes with `ar`."""
    # deferred, here and below: json, and config and the model code (torch), which
    # `import leapfrog.methods` does without
    import json

    from leapfrog.config import resolve_model
    try:
        folder = resolve_model(model)
    except FileNotFoundError:
        return "ar"
    from leapfrog.models.loader import model_meta
    method = model_meta(folder).get("default_method")
    if method in METHODS:
        return method
    if method is not None:
        from leapfrog.models.loader import CheckpointError
        raise CheckpointError(f"{Path(folder) / 'leapfrog.json'}: default_method {method!r} is not a method "
                              f"(available: {', '.join(sorted(METHODS))})")
    drafter = Path(folder) / "drafter" / "config.json"
    if drafter.is_file():      # the drafter's own layout says which method it was trained for
        from leapfrog.models.dflash import DrafterConfig
        try:
            return DrafterConfig.from_hf(json.loads(drafter.read_text())).kind
        except (ValueError, KeyError, json.JSONDecodeError):
            return "ar"
    return "ar"
