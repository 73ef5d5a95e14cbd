"""Command-line options shared by the commands that run an engine (generate, serve, eval, bench):
engine and sampling flags, and KEY=VALUE method options."""
from __future__ import annotations

import argparse
import json

from leapfrog.config import DEFAULT_MODEL
from leapfrog.sampling_params import BOUNDS, DEFAULT_MAX_TOKENS, SamplingParams


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The sampling flags, their defaults and ranges from SamplingParams (one table for Python,
    HTTP and the command line)."""
    base = SamplingParams()
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens to generate (default {DEFAULT_MAX_TOKENS}; {BOUNDS['max_tokens'].text})")
    model_default = "default: the model's generation_config.json, else"
    for name, kind, note in (("temperature", float, "0 = greedy; "), ("top_p", float, ""),
                             ("top_k", int, ""), ("min_p", float, ""), ("repetition_penalty", float, "")):
        g.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                       help=f"{note}{BOUNDS[name].text} ({model_default} {getattr(base, name)})")
    g.add_argument("--presence-penalty", type=float, default=base.presence_penalty,
                   help=BOUNDS["presence_penalty"].text)
    g.add_argument("--frequency-penalty", type=float, default=base.frequency_penalty,
                   help=BOUNDS["frequency_penalty"].text)
    g.add_argument("--seed", type=int, default=None, help="per-request seed (reproducible output)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", type=int, action="append", default=[], dest="stop_token_ids")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--min-tokens", type=int, default=0,
                   help="no end of text (or stop token id) before this many tokens")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help=f"checkpoint folder or built-in name (default {DEFAULT_MODEL})")
    g.add_argument("--method", default=None, help="decoding method (default: the model's best lossless one, else ar)")
    g.add_argument("--draft-model", default=None, help="drafter checkpoint folder for speculative methods; for "
                   "method draft, a small AR model sharing the tokenizer (e.g. stories)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), float32, bfloat16")
    g.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many ranks, started here (default 1; torchrun for several nodes)")
    g.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="cut the layers into this many pipeline stages, each its own rank(s) (default 1)")
    g.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra engine or method option, e.g. --option block_size=32 (repeatable)")


def parse_options(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--option {pair!r}: expected KEY=VALUE")
        key, value = pair.split("=", 1)
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


# the flags whose default is the model's generation_config.json, else SamplingParams'
MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_from_args(args: argparse.Namespace, model_defaults: dict | None = None):
    """Flags first, then the model's generation_config.json (``model_sampling_defaults``), then
    SamplingParams' defaults, as the server and the Python API choose them."""
    base = SamplingParams()
    defaults = {**{k: getattr(base, k) for k in MODEL_DEFAULTED}, **(model_defaults or {})}
    pick = {k: defaults[k] if getattr(args, k) is None else getattr(args, k) for k in MODEL_DEFAULTED}
    return SamplingParams(max_tokens=args.max_tokens, **pick,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.seed, stop=args.stop, stop_token_ids=args.stop_token_ids,
                          ignore_eos=args.ignore_eos, min_tokens=args.min_tokens)


def engine_kwargs(args: argparse.Namespace) -> dict:
    # deferred: methods loads only when engine options are built
    from leapfrog.methods import default_method
    kw = dict(method=args.method or default_method(args.model), draft_model=args.draft_model,
              device=args.device, dtype=args.dtype, **parse_options(args.option))
    if args.num_threads is not None:
        kw["num_threads"] = args.num_threads
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(args, name, 1) != 1:
            kw[name] = getattr(args, name)
    return kw
