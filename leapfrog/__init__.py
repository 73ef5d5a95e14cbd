"""leapfrog: a text-generation engine that emits more than one token per forward pass."""
import os

# OpenMP's worker threads wait for the next parallel region by spinning, then sleeping. A decode
# step runs dozens of short regions a few microseconds apart: sleeping at once (passive wait)
# paid a wake-up for each and made single-request decoding several times slower (measured in
# docs/decisions.md); spinning for long (libgomp's default, 300,000 spins) burns a shared CPU
# between steps. A short spin covers the
# gaps inside a step and sleeps between steps. It must be chosen before torch loads, so it is
# set here; export GOMP_SPINCOUNT or OMP_WAIT_POLICY to override.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
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
