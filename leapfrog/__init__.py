"""leapfrog: a text-generation engine that emits more than one token per forward pass."""
from leapfrog.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so `import leapfrog` (e.g. for the CLI's --help) does not import torch.
    if name == "LLM":
        from leapfrog.llm import LLM
        return LLM
    if name == "RequestOutput":
        from leapfrog.outputs import RequestOutput
        return RequestOutput
    raise AttributeError(name)
