"""The shipped checkpoints: they load unchanged in leapfrog and transformers, agree, and the
default model answers with no arguments."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from leapfrog.config import CHECKPOINT_DIRS
from leapfrog.models.loader import load_model
from leapfrog.tokenizer import Tokenizer

BUILTIN = [p for p in sorted(CHECKPOINT_DIRS[0].iterdir()) if (p / "config.json").is_file()] \
    if CHECKPOINT_DIRS[0].is_dir() else []
TEXTS = {"stories": "Once upon a time, a little girl named Lily found a red ball.",
         "couplets": "春回大地万象新"}


# Folders in a layout transformers has no class for (LLaDA2-MoE: stories-clover) have their oracle
# in tests/models/test_moe.py (the reference written from the layout's description).
IN_TRANSFORMERS = [p for p in BUILTIN if json.loads((p / "config.json").read_text()).get("model_type")
                   in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES]


def test_only_the_llada2_folder_lacks_a_transformers_oracle():
    assert sorted(p.name for p in BUILTIN if p not in IN_TRANSFORMERS) == \
        sorted(p.name for p in BUILTIN if p.name == "stories-clover")


@pytest.mark.parametrize("folder", IN_TRANSFORMERS, ids=lambda p: p.name)
def test_builtin_logits_and_tokens_match_transformers(folder):
    text = TEXTS.get(folder.name, "Hello")
    ours_tok = Tokenizer.from_folder(folder)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = ours_tok.encode(text)
    assert ids == hf_tok(text).input_ids
    ours = load_model(folder)                                  # verifies SHA256SUMS too
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    banned = list(ref.generation_config.suppress_tokens or [])  # transformers bans them in generate()
    with torch.no_grad():
        got, want = ours.forward_dense(x), ref(x).logits
        torch.testing.assert_close(load_model(folder, suppress=False).forward_dense(x), want, atol=1e-4, rtol=0)
    keep = [i for i in range(want.shape[-1]) if i not in banned]
    torch.testing.assert_close(got[..., keep], want[..., keep], atol=1e-4, rtol=0)
    assert (got[..., banned] < -1e8).all()
    assert (folder / "README.md").is_file() and (folder / "SHA256SUMS").is_file()


@pytest.mark.skipif(not any(p.name == "couplets" for p in BUILTIN), reason="couplets not trained yet")
@pytest.mark.parametrize("prompt", ["春回大地万象新", "关键词：春 福\n"])
def test_couplets_tokenizer_ends_a_raw_prompt_with_sep(prompt):
    """The couplets tokenizer marks the end of a prompt with <sep> as it marks the start with <s>,
    so a client sending the raw 上联 hands the model <s>上联<sep>: leapfrog and transformers alike."""
    folder = CHECKPOINT_DIRS[0] / "couplets"
    ours = Tokenizer.from_folder(folder)
    sep = ours.token_to_id("<sep>")
    ids = ours.encode(prompt)
    assert ids[0] == ours.bos_token_id and ids[-1] == sep
    assert ids == [ours.bos_token_id, *ours.encode(prompt, add_special_tokens=False), sep]
    assert ids[1:].count(ours.bos_token_id) == 0 and ids.count(sep) == 1
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf_tok(prompt).input_ids == ids
    assert hf_tok.decode(ids, skip_special_tokens=True) == ours.decode(ids) == prompt


@pytest.mark.skipif(not any(p.name == "stories" for p in BUILTIN), reason="stories not trained yet")
def test_generate_with_no_model_argument_tells_a_story():
    proc = subprocess.run([sys.executable, "-m", "leapfrog", "generate", "--max-tokens", "40",
                           "--temperature", "0", "Once upon a time"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    words = re.findall(r"[A-Za-z']+", proc.stdout)
    assert len(words) >= 15                                    # English words, not byte soup
    common = {"the", "a", "and", "was", "to", "she", "he", "they", "it", "her", "his"}
    assert sum(w.lower() in common for w in words) >= 3


@pytest.mark.skipif(not any(p.name == "stories" for p in BUILTIN), reason="stories not trained yet")
def test_offline_text_equals_streamed_text_with_sentencepiece():
    from leapfrog import LLM, SamplingParams
    llm = LLM("stories")
    params = SamplingParams(max_tokens=24, temperature=0)
    offline = llm.generate(["Once upon a time, there was"], params)[0].text
    engine = llm.engine
    engine.add_request("Once upon a time, there was", params, request_id="streamed")
    streamed = ""
    while engine.has_unfinished():
        streamed += "".join(o.delta_text for o in engine.step())
    assert streamed == offline and offline.startswith(" ")   # the first word keeps its space


# --- the shipped models stay reproducible: their recorded commands build the same configs -----

SHIPPED_DRAFTERS = sorted(p.parent for p in CHECKPOINT_DIRS[0].glob("*/drafters/*/training.json")) \
    if CHECKPOINT_DIRS[0].is_dir() else []
NOT_TRAINING = {"command", "out_dir", "run_dir"}     # where a run wrote, not what it trained


def _from_repo_root(value):
    """Paths recorded on the machine that trained, from the repository root on."""
    if isinstance(value, dict):
        return {k: _from_repo_root(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_repo_root(v) for v in value]
    return re.sub(r"^/.*?/(?=(checkpoints|runs)/)", "", value) if isinstance(value, str) else value


def _disagreements(recorded: dict, current: dict, where: str = "") -> list[str]:
    """Options both configs have and set differently, and recorded options that no longer exist
    but were on (a removed option must have been off in a shipped run)."""
    out = []
    for key, value in recorded.items():
        if key in NOT_TRAINING and not where:
            continue
        if key not in current:
            if value:
                out.append(f"{where}{key}={value!r} recorded, no such option now")
        elif isinstance(value, dict) and isinstance(current[key], dict):
            out += _disagreements(value, current[key], f"{where}{key}.")
        elif value != current[key]:
            out.append(f"{where}{key}: recorded {value!r}, now {current[key]!r}")
    return out


@pytest.mark.parametrize("folder", [p for p in BUILTIN if (p / "training.json").is_file()], ids=lambda p: p.name)
def test_the_recorded_command_still_builds_the_shipped_config(folder, monkeypatch):
    """`leapfrog train` with the command line recorded in training.json builds the config that
    trained the shipped weights, and every recipe the folder names (its own, its initial
    model's, its soup ingredients', its Reproduce commands') is one `leapfrog train` knows."""
    import json
    import shlex
    from dataclasses import asdict

    from leapfrog.train.cli import config_for
    from leapfrog.train.recipes import RECIPES, SHIPPED_BY

    summary = json.loads((folder / "training.json").read_text())
    recorded = summary["config"]
    argv = shlex.split(recorded["command"])[2:]
    cfg, _ = config_for(argv)
    current = json.loads(json.dumps(asdict(cfg), default=str))
    wrong = _disagreements(_from_repo_root(recorded), _from_repo_root(current))
    if wrong and argv[0] in SHIPPED_BY:     # being retrained: the recipe that made these weights
        monkeypatch.setitem(RECIPES, argv[0], SHIPPED_BY[argv[0]])
        cfg, _ = config_for(argv)
        current = json.loads(json.dumps(asdict(cfg), default=str))
        wrong = _disagreements(_from_repo_root(recorded), _from_repo_root(current))
    assert wrong == []
    named = {summary["recipe"], (summary.get("init") or {}).get("recipe")}
    named |= {s.get("recipe") for s in summary.get("soup", [])}
    named |= set(re.findall(r"leapfrog train ([\w-]+)", "\n".join(summary.get("reproduce") or [])))
    assert named - {None} <= set(RECIPES)


@pytest.mark.parametrize("folder", SHIPPED_DRAFTERS, ids=lambda p: p.name)
def test_the_recorded_command_still_builds_the_shipped_drafter_recipe(folder):
    import json
    import shlex
    from dataclasses import asdict

    from leapfrog.train.drafter import recipe_for

    recorded = json.loads((folder / "training.json").read_text())["recipe"]
    r, _ = recipe_for(shlex.split(recorded["command"])[3:])
    assert _disagreements({k: v for k, v in recorded.items() if k != "command"}, asdict(r)) == []


def test_the_couplet_models_chat_template_is_the_one_its_export_writes():
    from leapfrog.data.couplets import CHAT_TEMPLATE
    shipped = Path(__file__).resolve().parents[2] / "checkpoints" / "couplets" / "chat_template.jinja"
    assert shipped.read_text(encoding="utf-8") == CHAT_TEMPLATE
