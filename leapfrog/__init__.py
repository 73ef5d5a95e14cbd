"""leapfrog: a text-generation engine that emits more than one token per forward pass."""
import os

# OpenMP's default active wait spins threads between the many small ops of a decode step; on a
# CPU shared with other work that makes decode steps many times slower. Passive wait
# must be chosen before torch loads, so it is set here; export OMP_WAIT_POLICY to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
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
