"""Registry: the `architectures` string of config.json -> model class."""
from __future__ import annotations

import importlib

from torch import nn

MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("leapfrog.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("leapfrog.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("leapfrog.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("leapfrog.models.llama", "Qwen3ForCausalLM"),
    # Block-diffusion layouts (SDAR, Fast-dLLM v2): Qwen3 / Qwen2 weights, own config keys.
    "SDARForCausalLM": ("leapfrog.models.llama", "Qwen3ForCausalLM"),
    "Fast_dLLM_QwenForCausalLM": ("leapfrog.models.llama", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("leapfrog.models.llama", "Qwen2ForCausalLM"),   # MoE layers from config
    "Qwen3MoeForCausalLM": ("leapfrog.models.llama", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("leapfrog.models.gemma3", "Gemma3ForCausalLM"),
    "LLaDA2MoeModelLM": ("leapfrog.models.llada2_moe", "LLaDA2MoeModelLM"),
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"config.json: unsupported architecture {architecture!r}; "
                         f"supported: {', '.join(sorted(MODEL_REGISTRY))}")
    module, name = MODEL_REGISTRY[architecture]
    return getattr(importlib.import_module(module), name)
