"""`leapfrog generate`: stream a completion to stdout; diagnostics go to stderr."""
from __future__ import annotations

import argparse
import sys
import time

from leapfrog.options import add_engine_args, add_sampling_args, engine_kwargs, sampling_from_args
from leapfrog.sampling_params import defaults_for_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="leapfrog generate", description=__doc__)
    p.add_argument("prompt", nargs="?", default=None,
                   help="prompt text (default: stdin if something is piped, else 'Once upon a time')")
    p.add_argument("--chat", action="store_true", help="wrap the prompt with the model's chat template")
    p.add_argument("--stats", action="store_true", help="print speed and tokens/forward to stderr")
    add_engine_args(p)
    add_sampling_args(p)
    args = p.parse_args(argv)
    prompt = args.prompt
    if prompt is None:
        piped = sys.stdin.read() if not sys.stdin.isatty() else ""
        prompt = piped if piped.strip() else "Once upon a time"   # nothing piped: the default
    defaults = defaults_for_model(args.model, lambda msg: print(f"warning: {msg}", file=sys.stderr))
    try:
        params = sampling_from_args(args, defaults)
    except ValueError as e:
        p.error(str(e))
    # deferred: the engine loads only after the arguments parse
    from leapfrog.engine.llm_engine import LLMEngine
    try:
        kwargs = engine_kwargs(args)       # reads the model folder's leapfrog.json (default method)
        # deferred: engine.distributed loads only after the arguments parse
        from leapfrog.engine.distributed import num_ranks, start
        if num_ranks(kwargs) > 1:
            engine = start(args.model, kwargs)
        else:
            engine = LLMEngine(args.model, **kwargs)
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        engine.add_request(prompt, params, request_id="cli")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0, last = time.perf_counter(), None
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            last = out
    sys.stdout.write("\n")
    if hasattr(engine, "shutdown"):
        engine.shutdown()
    if args.stats and last is not None:
        m, dt = last.metrics, time.perf_counter() - t0
        print(f"[{m.num_output_tokens} tokens in {dt:.2f}s, {m.num_output_tokens / dt:.1f} tok/s, "
              f"{m.tokens_per_forward:.2f} tokens/forward, finish={last.finish_reason}]", file=sys.stderr)
    if last is not None and (last.finish_reason or "").startswith("error"):
        # the request failed in the engine (e.g. error:kv_cache_too_small): say so, and not exit 0
        print(f"error: the request failed ({last.finish_reason})", file=sys.stderr)
        return 1
    return 0
