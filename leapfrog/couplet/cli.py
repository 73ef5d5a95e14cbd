"""`leapfrog couplet 马年 吉祥`: a couplet for a few keywords, at the terminal."""
from __future__ import annotations

import argparse
import json
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leapfrog couplet", description="Write a Spring Festival couplet (春联) "
                                "for a few Chinese keywords with the built-in `couplets` model.")
    p.add_argument("keywords", nargs="+", help="one to eight Chinese keywords, e.g. 马年 吉祥")
    p.add_argument("--seed", type=int, default=None, help="the same keywords and seed write the same couplet")
    p.add_argument("--free", action="store_true",
                   help="the model alone: no rules enforced while decoding, no candidates reranked")
    p.add_argument("--candidates", type=int, default=8, help="candidates written and reranked (default 8)")
    p.add_argument("--model", default="couplets", help="a couplet model: built-in name or folder (default couplets)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # deferred: the app loads only after the arguments parse, so --help stays fast
    from leapfrog.couplet.rules import LABELS, split_keywords
    try:
        keywords = split_keywords(" ".join(args.keywords))
    except ValueError as exc:
        print(f"leapfrog couplet: {exc}", file=sys.stderr)
        return 2
    # deferred: torch and the engine load only once the keywords are valid
    from leapfrog.couplet.writer import CoupletWriter, write
    from leapfrog.llm import LLM
    try:
        llm = LLM(args.model, method="ar")
        writer = CoupletWriter(llm.tokenizer, num_candidates=args.candidates)
    except (FileNotFoundError, ValueError) as exc:
        print(f"leapfrog couplet: {exc}", file=sys.stderr)
        return 2
    c = write(llm, keywords, args.seed, not args.free, writer)
    if args.json:
        print(json.dumps(c.as_dict(), ensure_ascii=False, indent=2))
        return 0
    print(f"横批：{c.horizontal}\n上联：{c.upper}\n下联：{c.lower}")
    marks = "  ".join(f"{LABELS[k]}{'✓' if ok else '✗'}" for k, ok in c.rules.items())
    print(f"\n{marks}   {c.seconds:.2f} s", file=sys.stderr)
    return 0
