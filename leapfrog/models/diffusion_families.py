"""Block-diffusion checkpoint families: block size, mask token, logit shift and EOS in one place.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from leapfrog.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class DiffusionFamily:
    name: str
    block_size_key: str
    default_block_size: int | None
    mask_token_id: int | None
    logit_shift: bool
    eos_token_ids: tuple[int, ...] = ()


FAMILIES: dict[str, DiffusionFamily] = {
    "SDARForCausalLM": DiffusionFamily("sdar", "block_size", None, 151669, False, (151645, 151643)),
    "Fast_dLLM_QwenForCausalLM": DiffusionFamily("fast_dllm_v2", "bd_size", 32, 151665, True, (151645,)),
    "LLaDA2MoeModelLM": DiffusionFamily("llada2", "block_size", 32, 156895, False, (156892,)),
}
LEAPFROG = DiffusionFamily("leapfrog", "block_size", None, None, False)


@dataclass(frozen=True, slots=True)
class DiffusionSpec:
    """What the diffusion method needs to know about one checkpoint."""
    family: str
    block_size: int
    mask_token_id: int
    logit_shift: bool
    eos_token_ids: tuple[int, ...]


def family_of(config: dict) -> DiffusionFamily:
    archs = config.get("architectures") or []
    return FAMILIES.get(archs[0], LEAPFROG) if archs else LEAPFROG


def diffusion_spec(config: dict, tokenizer: "Tokenizer") -> DiffusionSpec:
    """Resolve block size, mask id, shift and EOS for a checkpoint; ValueError naming the key
    when the folder is not a usable block-diffusion checkpoint."""
    fam = family_of(config)
    vocab = int(config["vocab_size"])
    block = config.get(fam.block_size_key, config.get("block_size", config.get("bd_size", fam.default_block_size)))
    if block is None:
        raise ValueError("config.json names no diffusion block size (block_size, or bd_size for "
                         "Fast-dLLM v2): not a block-diffusion checkpoint")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"config.json: diffusion block size {block!r} must be a positive integer")
    # config.json first (SDAR and leapfrog write it), then the tokenizer's mask token, then the family's.
    candidates = (config.get("mask_token_id"), tokenizer.mask_token_id, fam.mask_token_id)
    mask = next((m for m in candidates if isinstance(m, int) and 0 <= m < vocab), None)
    if mask is None:
        raise ValueError("model has no mask token: set mask_token_id in config.json or name a "
                         "mask_token in tokenizer_config.json")
    shift = config.get("diffusion_logit_shift", fam.logit_shift)
    if not isinstance(shift, bool):
        raise ValueError(f"config.json: diffusion_logit_shift={shift!r} must be true or false")
    eos = [*tokenizer.eos_token_ids, *(e for e in fam.eos_token_ids if e < vocab)]
    return DiffusionSpec(fam.name, block, mask, shift, tuple(dict.fromkeys(eos)))
