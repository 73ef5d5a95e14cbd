"""`leapfrog run-batch -i requests.jsonl -o results.jsonl`: a batch file through the engine,
offline, in vLLM's run-batch format (one OpenAI request per line: custom_id, method, url, body).

The engine is the server's (the same flags as `leapfrog serve`, the same answers as its
endpoints and its Batch API), with no HTTP. Progress is kept in SQLite under --batch-dir: run
again after a crash, it does only the lines not yet done. The output has exactly one line per
input line, in input order: the response, or the line's error."""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

from leapfrog.checkpoint.gguf import CheckpointError
from leapfrog.config import resolve_model
from leapfrog.serve.config import ConfigError, add_arguments, build_config, flags_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leapfrog run-batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--input-file", required=True, help="the requests, one JSON object a line")
    p.add_argument("-o", "--output-file", required=True, help="the results, one JSON object a line, in input order")
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    inp, out = Path(args.input_file), Path(args.output_file)
    try:
        flags = flags_from_args(argparse.Namespace(**{k: v for k, v in vars(args).items()
                                                      if k not in ("input_file", "output_file")}))
        flags.setdefault("warmup_requests", 0)
        cfg = build_config(flags)
    except ConfigError as exc:
        print(f"leapfrog run-batch: configuration error: {exc}", file=sys.stderr)
        return 2
    if not inp.is_file():
        print(f"leapfrog run-batch: {inp}: no such file", file=sys.stderr)
        return 2
    # deferred: the loader (and torch) only once the arguments are good
    from leapfrog.models.loader import read_config
    try:
        for view in cfg.views():      # a model that is not there fails here, not in the engine thread
            folder = resolve_model(view.model)
            if folder.is_dir():
                read_config(folder)
    except (FileNotFoundError, CheckpointError) as exc:
        print(f"leapfrog run-batch: {exc}", file=sys.stderr)
        return 2
    problem = _output_problem(inp, out)
    if problem is not None:
        print(f"leapfrog run-batch: {out}: {problem}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run(cfg, inp, out))
    except OSError as exc:          # the progress folder or the output, found unwritable on the way
        print(f"leapfrog run-batch: {exc}", file=sys.stderr)
        return 2


def _output_problem(inp: Path, out: Path) -> str | None:
    """Why the results could not be written there, checked before any line runs."""
    if out.exists() and out.is_dir():
        return "is a folder; the output is a file"
    if out.exists() and inp.exists() and out.resolve() == inp.resolve():
        return "is the input file; the results would overwrite it"
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        return f"its folder {str(folder)!r} does not exist"
    if not os.access(folder, os.W_OK):
        return f"its folder {str(folder)!r} is not writable"
    return None


async def run(cfg, inp: Path, out: Path) -> int:
    # deferred: the HTTP core and FastAPI load only when a batch runs
    from leapfrog.serve.app import ServerState
    from leapfrog.serve.batches import BatchRunner, BatchStore, default_data_dir, parse_lines, progress_db
    data = inp.read_bytes()
    store = BatchStore(progress_db(Path(cfg.batch_dir or default_data_dir()), inp, out))
    bid = "batch_run_" + hashlib.sha256(data).hexdigest()[:24]      # another input: another batch
    if store.batch(None, bid) is None:
        try:
            lines = parse_lines(data, None, max(cfg.max_batch_lines, 1 << 30))
        except ValueError as exc:
            print(f"leapfrog run-batch: {inp}: {exc}", file=sys.stderr)
            return 2
        store.create_batch("", str(inp), "", lines, None, bid=bid)
    obj = store.batch(None, bid)
    if obj.get("expires_at") is not None or obj["status"] == "expired":
        # an offline run has no completion window: its lines run however long it takes, and a
        # run that an earlier version let expire goes on with the lines it had left
        store.update(bid, expires_at=None, expired_at=None,
                     status="in_progress" if obj["status"] == "expired" else obj["status"])
    obj = store.batch(None, bid)
    counts = obj["request_counts"]
    state = ServerState(cfg)
    loop = asyncio.get_running_loop()
    for m in state.servers:
        m.engine.start(loop)
    supervisors = [asyncio.create_task(m.engine.supervise()) for m in state.servers]
    try:
        for m in state.servers:
            while not m.engine.ready.is_set():
                if m.engine.load_error is not None:
                    print(f"leapfrog run-batch: {m.engine.load_error}", file=sys.stderr)
                    return 2 if isinstance(m.engine.load_error, (ValueError, FileNotFoundError)) else 1
                await asyncio.sleep(0.05)
        bar = tqdm(total=counts["total"], initial=counts["completed"] + counts["failed"], unit="line",
                   desc="run-batch", disable=None)
        runner = BatchRunner(state, store, on_line=lambda: bar.update(1))
        await runner.run(bid)
        bar.close()
    finally:
        for task in supervisors:
            task.cancel()
        await asyncio.gather(*(asyncio.to_thread(m.engine.stop) for m in state.servers))
    # deferred with the rest of the batch store
    from leapfrog.serve.batches import result_line
    tmp = out.with_name(out.name + ".tmp")
    unrun = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for _, cid, result, _ in store.results(bid):
            if result is None:          # never written as null: the line's own error
                unrun += 1
                result = result_line(cid, None, None, {"code": "not_run", "message": "the line did not run; run "
                                                       "leapfrog run-batch again to run it"})
            f.write(json.dumps(result, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    final = store.batch(None, bid)["request_counts"]
    print(f"leapfrog run-batch: {final['completed']} lines answered, {final['failed']} errors"
          + (f", {unrun} not run" if unrun else "") + f" -> {out}", file=sys.stderr)
    return 1 if unrun else 0
