"""`make models` runs for days across sessions: a stage that names a recipe, drafter variant or
flag that does not exist would only fail hours in. Every command it would run is parsed here
against the training command lines, without running anything."""
from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _planned_commands(tmp_path: Path) -> list[list[str]]:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # -n prints the commands; -B as if nothing were done yet; runs/done of the checkout is not read
    out = subprocess.run(["make", "-n", "-B", "models", f"DONE={tmp_path / 'done'}", "VENV=.venv"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    joined = out.replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if " train " in line and "leapfrog" in line]


def test_every_stage_of_make_models_parses(tmp_path):
    from leapfrog.train.cli import config_for
    from leapfrog.train.drafter import recipe_for
    from leapfrog.train.recipes import RECIPES

    commands = _planned_commands(tmp_path)
    trained = set()
    for argv in commands:
        args = argv[argv.index("train") + 1:]
        if args[0] == "drafter":
            # the --init-from folder is computed by the shell at run time
            args = ["/built/at/run/time" if a.startswith("$(") else a for a in args]
            r, _ = recipe_for(args[1:])
            trained.add(f"drafter {r.name} -> {r.target}")
        else:
            assert args[0] in RECIPES, args[0]
            config_for(args)
            trained.add(args[0])
    # the user-facing models, their derived ones, and stories before anything grown from it
    assert {"stories", "stories-polish", "stories-unrepeat", "stories-context", "couplets", "stories-large",
            "stories-moe", "stories-diffusion-distill2", "stories-diffusion-stream"} <= trained
    names = [a[a.index("train") + 1] for a in commands]
    chain = ["stories", "stories-polish", "stories-unrepeat", "stories-context", "stories-large"]
    assert [names.index(n) for n in chain] == sorted(names.index(n) for n in chain)


def test_a_stage_added_to_a_finished_chain_still_runs(tmp_path):
    """A stage whose marker is missing runs on the next `make models` even where the markers after
    it exist (a stage inserted into a finished chain, or one to redo): a missing marker is never
    treated as an intermediate file make may skip."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    done = tmp_path / "done"
    done.mkdir()
    stages = ["stories", "stories-polish", "stories-run", "stories-diffusion", "stories-diffusion-mb",
              "stories-diffusion-distill", "stories-diffusion-distill2", "stories-large-delta",
              "drafter-dspark-markov-2l", "drafter-dflash-2l", "large-drafter-dspark-markov-2l",
              "large-drafter-dflash-2l", "stories-large"]
    for name in stages:
        if name != "stories-diffusion-distill2":  # every marker of the chain but one stage's
            (done / name).touch()
    out = subprocess.run(["make", "-n", f"{done}/stories-large", f"DONE={done}", "VENV=.venv"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "train stories-diffusion-distill2" in out


def test_the_stages_that_finish_stories_train_every_position_of_its_context():
    """Every stories stage once drew 256-token windows while the model's context is 512: positions
    256-511 were never trained, and held-out loss there was 3.3-5.0 nats against 2.3-2.6 before
    them. The stage that writes checkpoints/stories and the stories-large delta read whole contexts."""
    from leapfrog.train.recipes import RECIPES
    for name in ("stories-context", "stories-large"):
        cfg = RECIPES[name]()
        assert cfg.seq_len == cfg.model.max_position, name
