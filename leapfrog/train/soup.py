"""Weight soups: a checkpoint folder whose weights are a weighted mean of several checkpoints of
one architecture, typically fine-tunes that share a parent.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import torch

# config.json keys that must agree for two folders' weights to be averaged meaningfully
ARCH_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings",
             "max_position_embeddings")
REWRITTEN = ("README.md", "SHA256SUMS", "training.json")


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    # deferred: the model loader loads only when weights are read
    from leapfrog.models.loader import iter_tensors, weight_files
    return {name: t for _, name, t in iter_tensors(weight_files(folder))}


def mix(folders: list[Path], weights: list[float]) -> dict[str, torch.Tensor]:
    """sum_i weights[i] * folder_i's tensors, computed in fp32 and stored in the last folder's
    dtypes. Raises naming the file and the mismatch when the folders do not share an
    architecture, tensor names or shapes."""
    if len(folders) != len(weights) or len(folders) < 2:
        raise ValueError("give at least two folders and one weight per folder")
    if any(not math.isfinite(w) or w < 0 for w in weights) or not math.isclose(sum(weights), 1.0, abs_tol=1e-6):
        raise ValueError(f"weights must be >= 0 and sum to 1, got {weights}")
    # deferred: the model loader loads only when a soup is mixed
    from leapfrog.models.loader import read_config

    base_cfg, base = read_config(folders[-1]), _weights(folders[-1])
    total = {name: torch.zeros(t.shape, dtype=torch.float32) for name, t in base.items()}
    for folder, w in zip(folders, weights):
        cfg = read_config(folder)
        for key in ARCH_KEYS:
            if cfg.get(key) != base_cfg.get(key):
                raise ValueError(f"{folder / 'config.json'}: {key} is {cfg.get(key)!r} but "
                                 f"{folders[-1] / 'config.json'} has {base_cfg.get(key)!r}")
        tensors = base if folder == folders[-1] else _weights(folder)
        if set(tensors) != set(base):
            diff = sorted(set(tensors) ^ set(base))[:3]
            raise ValueError(f"{folder}: weight names differ from {folders[-1]}'s (e.g. {diff})")
        for name, t in tensors.items():
            if t.shape != base[name].shape:
                raise ValueError(f"{folder}: {name} has shape {tuple(t.shape)}, "
                                 f"{folders[-1]} has {tuple(base[name].shape)}")
            total[name] += w * t.float()
    return {name: total[name].to(base[name].dtype).contiguous() for name in base}


def write_soup(folders: list[str | Path], weights: list[float], out: str | Path,
               measure: bool = True, notes: list[str] | None = None) -> dict:
    """Write the soup to ``out`` (may be one of the ingredients: everything is read first) and
    return its training summary. With ``measure``, validation loss is re-measured on the last
    ingredient's recipe's validation stream and the folder's check rerun for its README."""
    # deferred: safetensors loads only when a soup is written
    from safetensors.torch import save_file

    folders = [Path(f) for f in folders]
    out = Path(out)
    mixed = mix(folders, weights)
    base = folders[-1]
    summaries = [_summary(f) for f in folders]
    # Stage in a temporary folder, then replace: `out` may be an ingredient.
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
        stage = Path(tmp) / "soup"
        stage.mkdir()
        for path in base.iterdir():
            if path.is_file() and path.suffix != ".safetensors" and path.name not in REWRITTEN:
                shutil.copy(path, stage / path.name)
        save_file(mixed, str(stage / "model.safetensors"), metadata={"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(stage, out)
    summary = dict(summaries[-1]) if summaries[-1] else {}
    summary["soup"] = [{"folder": _display(f), "recipe": (s or {}).get("recipe"), "weight": w}
                       for f, s, w in zip(folders, summaries, weights)]
    recipe = "soup of " + " + ".join(f"{w:g} x {_display(f)}" for f, w in zip(folders, weights))
    summary["notes"] = list(notes if notes is not None else summary.get("notes", [])) + [
        f"These weights are a soup, not a training run's output: {recipe} "
        f"(`python -m leapfrog.train.soup`); the training table above describes the run that "
        f"made {_display(base)}, whose tokenizer and configs the soup keeps."]
    if measure and summary.get("recipe") and summary.get("config"):
        loss = validation_loss(out, summary["recipe"], summary["config"].get("data_dir"))
        if loss is not None:
            summary["val_loss"], summary["val_ppl"] = round(loss, 4), round(math.exp(loss), 3)
    if summary.get("config"):       # training.json, README.md (check rerun), SHA256SUMS
        # deferred: the README writer loads only for a summary with a config
        from leapfrog.train.readme import refresh_folder
        check = refresh_folder(out, summary, measure=measure)
        summary = dict(summary, check=check.metrics, check_samples=check.samples)
    else:
        # deferred: train.export loads only when sums are written
        from leapfrog.train.export import write_sha256sums
        (out / "training.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False, default=str))
        write_sha256sums(out)
    return summary


def validation_loss(folder: Path, recipe: str, data_dir: str | None) -> float | None:
    """The recipe's validation loss (same windows as during training) for the folder's weights,
    or None when the recipe is unknown here."""
    # deferred: the trainer modules load only when loss is measured
    from leapfrog.train.loop import evaluate, load_pretrained
    from leapfrog.train.prepare import prepare
    from leapfrog.train.recipes import RECIPES

    if recipe not in RECIPES:
        return None
    cfg = RECIPES[recipe]()
    cfg.data_dir = data_dir or cfg.data_dir
    prep = prepare(cfg.name, cfg.tokenizer, cfg.data_dir, cfg.seed, cfg.model.max_position,
                   cfg.long_repeats)
    model, _ = load_pretrained(str(folder))
    loss, _ = evaluate(model, prep.val, cfg)
    return loss


def _summary(folder: Path) -> dict | None:
    path = folder / "training.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _display(folder: Path) -> str:
    # deferred: data.corpus loads only when a folder is displayed
    from leapfrog.data.corpus import REPO_ROOT
    try:
        return str(folder.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(folder)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m leapfrog.train.soup",
        description="Average the weights of checkpoint folders of one architecture into a new folder.")
    p.add_argument("folders", nargs="+", help="ingredients; the last one gives tokenizer and configs")
    p.add_argument("--weights", type=float, nargs="+", default=None,
                   help="one per folder, summing to 1 (default: equal)")
    p.add_argument("--out", required=True, help="folder to write (may be one of the ingredients)")
    p.add_argument("--no-measure", action="store_true",
                   help="skip re-measuring validation loss and the README check")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    weights = args.weights or [1.0 / len(args.folders)] * len(args.folders)
    try:
        summary = write_soup(args.folders, weights, args.out, measure=not args.no_measure)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: summary.get(k) for k in ("soup", "val_loss", "check")}, ensure_ascii=False, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
