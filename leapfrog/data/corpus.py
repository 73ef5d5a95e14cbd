"""Training data for the built-in models: reading, a deterministic validation split, token caches.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
CACHE_DIR = REPO_ROOT / "data_cache"
END_OF_TEXT = "<|endoftext|>"
# Percent of items held out; the split hashes the item (the 上联 for couplets), so it does not
# depend on file order and every 下联 of a held-out 上联 is held out with it.
HELDOUT_PERCENT = {"stories": 4, "couplets": 2}

STORY_SPLIT_FILES = ("tinystories_cased.txt", "tinystories_valid.txt")
STORY_TRAIN_ONLY_FILES = ("tinystories_lowercase.txt",)
COUPLET_SPLIT_FILE = "couplets.tsv"
SPRING_FILE = "spring_festival.tsv"
POETRY_FILE = "poetry_pairs.tsv"


def data_root(data_dir: str | os.PathLike | None = None) -> Path:
    """The shared data folder: the argument, else $LEAPFROG_DATA_DIR, else ../shared/data."""
    root = Path(data_dir or os.environ.get("LEAPFROG_DATA_DIR") or DEFAULT_DATA_DIR)
    if not root.is_dir():
        raise FileNotFoundError(f"data folder {root} does not exist (pass --data-dir)")
    return root


def read_stories(path: Path) -> list[str]:
    """Stories separated by lines that are exactly <|endoftext|>; paragraphs keep their newlines."""
    stories, lines = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if line == END_OF_TEXT:
                if lines:
                    stories.append("\n".join(lines).strip())
                lines = []
            else:
                lines.append(line)
    if lines:
        stories.append("\n".join(lines).strip())
    return [s for s in stories if s]


def read_tsv(path: Path) -> list[tuple[str, ...]]:
    """Tab-separated records, blank lines skipped."""
    with open(path, encoding="utf-8") as f:
        return [tuple(line.rstrip("\n").split("\t")) for line in f if line.strip()]


def is_heldout(key: str, name: str) -> bool:
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT[name]


def _story_pool(root: Path) -> list[str]:
    pool: list[str] = []
    for fname in STORY_SPLIT_FILES:
        pool += read_stories(root / "stories" / fname)
    return pool


def heldout(name: str, data_dir: str | None = None) -> list:
    """The validation split: story strings for "stories", (上联, 下联) tuples for "couplets".

    Deterministic (hash of the text), disjoint from ``train_items`` and stable across runs.
    """
    root = data_root(data_dir)
    if name == "stories":
        return [s for s in _story_pool(root) if is_heldout(s, name)]
    if name == "couplets":
        pairs = read_tsv(root / "couplets" / COUPLET_SPLIT_FILE)
        return [(p[0], p[1]) for p in pairs if len(p) >= 2 and is_heldout(p[0], name)]
    raise ValueError(f"unknown dataset {name!r}; expected 'stories' or 'couplets'")


def train_items(name: str, data_dir: str | None = None, truecase: bool = False) -> dict[str, list]:
    """Training items by source: stories -> {"stories": [...]}; couplets -> pairs and triples.

    Couplet sources: "pairs" (上联, 下联) from couplets.tsv + poetry, "spring" (上联, 下联, 横批).
    Any record whose first side is a held-out 上联 is dropped, whatever file it comes from.
    ``truecase`` (stories): the lowercased file's stories get their capitals back, from the
    casing of the cased training stories (data.truecase).
    """
    root = data_root(data_dir)
    if name == "stories":
        kept = [s for s in _story_pool(root) if not is_heldout(s, name)]
        table = None
        if truecase:
            # deferred: the casing table loads only for truecased items
            from leapfrog.data.truecase import CasingTable
            table = CasingTable.learn(kept)
        for fname in STORY_TRAIN_ONLY_FILES:
            path = root / "stories" / fname
            if path.exists():
                extra = [s for s in read_stories(path) if not is_heldout(s, name)]
                kept += [table.apply(s) for s in extra] if table else extra
        return {"stories": kept}
    if name == "couplets":
        held = {p[0] for p in heldout(name, data_dir)} | {p[1] for p in heldout(name, data_dir)}
        pairs = read_tsv(root / "couplets" / COUPLET_SPLIT_FILE)
        poetry = read_tsv(root / "couplets" / POETRY_FILE) if (root / "couplets" / POETRY_FILE).exists() else []
        spring = read_tsv(root / "couplets" / SPRING_FILE)
        ok = lambda r, n: len(r) >= n and r[0] not in held and r[1] not in held  # noqa: E731
        return {
            "pairs": [(r[0], r[1]) for r in pairs + poetry if ok(r, 2)],
            "spring": [(r[0], r[1], r[2]) for r in spring if ok(r, 3)],
        }
    raise ValueError(f"unknown dataset {name!r}; expected 'stories' or 'couplets'")


EXTRA_FILES = {("stories", "classics"): "classics.txt"}


def extra_items(name: str, source: str, data_dir: str | None = None) -> list[str]:
    """A training-only source of dataset ``name`` (``EXTRA_FILES``): its items as strings."""
    if (name, source) not in EXTRA_FILES:
        known = sorted(s for n, s in EXTRA_FILES if n == name)
        raise ValueError(f"{name}: no extra source {source!r} (known: {', '.join(known) or 'none'})")
    path = data_root(data_dir) / name / EXTRA_FILES[name, source]
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the {source!r} source of {name} is missing")
    return read_stories(path)


# ---------------------------------------------------------------------------------------------
# Token caches: one flat uint16 stream per split, memory-mapped for training.


def cache_path(name: str, split: str, tag: str) -> Path:
    return CACHE_DIR / name / f"{split}-{tag}.bin"


def write_stream(path: Path, docs: list[list[int]]) -> np.memmap:
    """Concatenate token lists into one uint16 file (vocabularies here are < 65,536)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    total = sum(len(d) for d in docs)
    tmp = path.with_suffix(".tmp")
    arr = np.memmap(tmp, dtype=np.uint16, mode="w+", shape=(total,))
    pos = 0
    for d in docs:
        arr[pos:pos + len(d)] = d
        pos += len(d)
    arr.flush()
    del arr
    os.replace(tmp, path)  # atomic: a half-written cache is never picked up
    return load_stream(path)


def load_stream(path: Path) -> np.memmap:
    return np.memmap(path, dtype=np.uint16, mode="r")


def fingerprint(*parts: object) -> str:
    """Short hash naming a cache, so a change of tokenizer or data makes a new file."""
    h = hashlib.sha1()
    for p in parts:
        h.update(repr(p).encode("utf-8"))
    return h.hexdigest()[:12]
