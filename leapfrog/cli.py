"""`leapfrog` console script: serve, run-batch, generate, bench, train, eval, info, couplet.

Each subcommand owns its argument parser in its own module; this file only dispatches, so
`leapfrog --help` stays fast (no torch import).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = {
    "serve": ("leapfrog.serve.main", "start the HTTP server (default: built-in model, port 8080)"),
    "generate": ("leapfrog.generate", "generate text from a prompt, streaming to stdout"),
    "bench": ("leapfrog.bench.cli", "benchmark leapfrog against peers and decoding methods"),
    "train": ("leapfrog.train.cli", "train a built-in model or drafter from a recipe"),
    "eval": ("leapfrog.eval.evaluate", "quality metrics for a model and decoding method"),
    "info": ("leapfrog.models.info", "total and active parameters of a model, from its config.json"),
    "run-batch": ("leapfrog.serve.run_batch", "run a file of OpenAI requests offline (vLLM's run-batch format), resumable"),
    "couplet": ("leapfrog.couplet.cli", "write a Spring Festival couplet (春联) for a few keywords"),
}


def short_openmp_spin() -> None:
    """OpenMP's threads spin a little (libgomp's GOMP_SPINCOUNT) before sleeping between parallel
    regions: a decode step runs dozens of short regions, and sleeping at once pays a wake-up for
    each, while libgomp's long default spin burns a shared CPU between steps (docs/decisions.md,
    CPU performance). It must be set before torch loads; an exported GOMP_SPINCOUNT or
    OMP_WAIT_POLICY wins. The commands call it; a program importing leapfrog may too."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = argparse.ArgumentParser(prog="leapfrog", description="leapfrog text-generation engine")
        sub = parser.add_subparsers(dest="command", metavar="COMMAND")
        for name, (_, help_text) in COMMANDS.items():
            sub.add_parser(name, help=help_text, add_help=False)
        parser.add_argument("--version", action="version", version="leapfrog 0.1.0")
        if argv and argv[0] not in ("-h", "--help", "--version"):
            parser.error(f"unknown command {argv[0]!r}")
        parser.parse_args(argv or ["--help"])
        return 0
    target = COMMANDS[argv[0]][0]
    if argv[0] == "bench" and _suite(argv[1:]) == "train":
        target = "leapfrog.train.speed"     # training's own benchmark: bench and train stay apart
    short_openmp_spin()
    try:
        module = importlib.import_module(target)
        return int(module.main(argv[1:]) or 0)
    except KeyboardInterrupt:                # Ctrl-C: stop quietly, the shell's code for it
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:                  # the reader went away (`| head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _suite(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--suite" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--suite="):
            return arg.split("=", 1)[1]
    return None


if __name__ == "__main__":
    sys.exit(main())
