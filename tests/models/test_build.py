"""Models built on first use from a recipe (leapfrog/checkpoint/build.py): function-preserving growth.

Oracles: the base model itself. A model grown wider and deeper computes the base model's logits;
a drafter grown with it proposes the base drafter's drafts, so speculative decoding on the grown
pair gives the base pair's tokens; a recipe folder resolves to a built folder whose files match
its SHA256SUMS, and a mismatch is an error naming the file.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from leapfrog import LLM, SamplingParams
from leapfrog.checkpoint.build import BuildError, grow_tensors, materialize, sha256
from leapfrog.models.loader import load_model

IDS = torch.tensor([[1, 40, 33, 95, 120, 7, 8, 9, 300, 200, 17, 5, 6]])


def grow_folder(src: Path, dst: Path, width: int, depth: int) -> Path:
    cfg = json.loads((src / "config.json").read_text())
    tensors, new = grow_tensors(load_file(str(src / "model.safetensors")), cfg, width, depth)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(new))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(src / f, dst / f)
    return dst


@pytest.mark.parametrize("width,depth", [(2, 1), (4, 2), (1, 3)])
def test_grown_model_computes_the_base_logits(llama_dir, tmp_path, width, depth):
    grown = grow_folder(llama_dir, tmp_path / "g", width, depth)
    cfg = json.loads((grown / "config.json").read_text())
    assert cfg["hidden_size"] == 64 * width and cfg["num_hidden_layers"] == 2 * depth
    assert cfg["num_attention_heads"] == 4 * width and cfg["num_key_value_heads"] == 2 * width
    base, big = load_model(llama_dir).forward_dense(IDS), load_model(grown).forward_dense(IDS)
    torch.testing.assert_close(big, base, atol=2e-5, rtol=1e-5)


def test_tied_embeddings_scale_the_final_norm(family_dirs, tmp_path):
    """qwen2's tiny model ties its embeddings: the LM head reads the copied hidden state."""
    src = family_dirs["qwen2"]
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"   # same tensors, Llama names
    tensors = load_file(str(src / "model.safetensors"))
    tensors = {n: t for n, t in tensors.items() if not n.endswith("_proj.bias")}
    grown, _ = grow_tensors(tensors, cfg, 4, 1)
    torch.testing.assert_close(grown["model.norm.weight"], tensors["model.norm.weight"].float().repeat(4) / 4)
    assert "lm_head.weight" not in grown


def test_growth_refuses_what_it_cannot_preserve(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    tensors = load_file(str(llama_dir / "model.safetensors"))
    with pytest.raises(BuildError, match="power of two"):
        grow_tensors(tensors, cfg, 3, 1)
    with pytest.raises(BuildError, match="Llama"):
        grow_tensors(tensors, {**cfg, "architectures": ["Qwen3ForCausalLM"]}, 2, 1)


def write_recipe(root: Path, base: str, drafters: dict | None = None) -> Path:
    recipe = root / "grown"
    recipe.mkdir(parents=True)
    (recipe / "build.json").write_text(json.dumps({"base": base, "width": 2, "depth": 2, "delta": None,
                                                   "files": ["leapfrog.json"], "drafters": drafters or {}}))
    (recipe / "leapfrog.json").write_text(json.dumps({"default_method": "ar"}))
    return recipe


def test_a_recipe_folder_builds_once_and_checks_its_sums(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPFROG_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "ckpts"
    shutil.copytree(llama_dir, root / "base")
    recipe = write_recipe(root, "base")
    built = materialize(recipe)
    assert built != recipe and (built / "model.safetensors").is_file() and (built / "leapfrog.json").is_file()
    assert materialize(recipe) == built                                    # built once, then reused
    out = LLM(str(recipe)).generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0))[0]
    want = LLM(str(llama_dir)).generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0))[0]
    assert out.token_ids == want.token_ids
    # SHA256SUMS of the built files are checked: a wrong digest is an error naming the file
    digest = sha256(built / "model.safetensors")
    (recipe / "SHA256SUMS").write_text(f"{digest}  model.safetensors\n{'0' * 64}  config.json\n")
    with pytest.raises(BuildError, match="config.json does not match"):
        materialize(recipe)                    # the recipe changed: a new build, which fails the check
    (recipe / "SHA256SUMS").write_text(f"{digest}  model.safetensors\n")
    rebuilt = materialize(recipe)
    assert (rebuilt / "model.safetensors").is_file()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [rebuilt.name]    # the old build removed


def test_a_missing_base_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPFROG_CACHE", str(tmp_path / "cache"))
    recipe = write_recipe(tmp_path, "no-such-base")
    with pytest.raises(BuildError, match="no-such-base"):
        materialize(recipe)


@pytest.mark.parametrize("narrow", [False, True])
def test_grown_drafters_keep_speculative_decoding_equal(llama_dir, tmp_path, monkeypatch, narrow):
    """A DSpark drafter grown with its target, or kept at its width with its fc reading the
    wider features and the base's embedding and LM head as its own (narrow), proposes the same
    drafts: greedy dspark on the grown target gives the base pair's tokens, with the same number
    of target forwards."""
    from test_speculative import write_drafter
    monkeypatch.setenv("LEAPFROG_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "ckpts"
    shutil.copytree(llama_dir, root / "base")
    write_drafter(root / "base" / "drafters" / "dspark", llama_dir, "dspark", num_layers=2, block_size=4)
    spec = {"from": "base/drafters/dspark", "narrow": True} if narrow else "base/drafters/dspark"
    recipe = write_recipe(root, "base", {"drafters/dspark": spec})
    built = materialize(recipe)
    dcfg = json.loads((built / "drafters" / "dspark" / "config.json").read_text())
    base_cfg = json.loads((root / "base" / "config.json").read_text())
    assert dcfg["hidden_size"] == base_cfg["hidden_size"] * (1 if narrow else 2)
    assert dcfg.get("target_hidden_size", dcfg["hidden_size"]) == 2 * base_cfg["hidden_size"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = ["Once upon a time", "The cat liked to play"]
    base = LLM(str(root / "base"), method="dspark", draft_model=str(root / "base" / "drafters" / "dspark"))
    grown = LLM(str(built), method="dspark", draft_model=str(built / "drafters" / "dspark"))
    assert (grown.engine.method.drafter.lm_head is not None) == narrow
    a, b = base.generate(prompts, params), grown.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.metrics.num_forwards for o in a] == [o.metrics.num_forwards for o in b]


def test_a_narrow_drafter_on_the_wrong_target_is_refused(llama_dir, tmp_path, monkeypatch):
    """A narrow drafter reads features of its target's width: on the base model itself (half
    that width) loading stops with a message naming both widths."""
    from test_speculative import write_drafter
    monkeypatch.setenv("LEAPFROG_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "ckpts"
    shutil.copytree(llama_dir, root / "base")
    write_drafter(root / "base" / "drafters" / "dspark", llama_dir, "dspark", num_layers=2, block_size=4)
    built = materialize(write_recipe(root, "base", {"drafters/dspark": {"from": "base/drafters/dspark", "narrow": True}}))
    with pytest.raises(ValueError, match="features of width"):
        LLM(str(root / "base"), method="dspark", draft_model=str(built / "drafters" / "dspark"))


def test_the_shipped_stories_large_recipe_builds_and_decodes_as_stories(tmp_path, monkeypatch):
    """A fresh clone: `stories-large` builds from the shipped `stories` weights, its files match
    the recipe's SHA256SUMS, and dspark on it (with its grown drafter) writes stories' greedy text."""
    monkeypatch.setenv("LEAPFROG_CACHE", str(tmp_path))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    large = LLM("stories-large", method="dspark").generate(["Once upon a time"], params)[0]
    small = LLM("stories").generate(["Once upon a time"], params)[0]
    assert large.token_ids == small.token_ids
    built = next(tmp_path.iterdir())
    assert json.loads((built / "config.json").read_text())["hidden_size"] == 1024


def test_the_shipped_diffusion_recipe_builds_and_decodes_as_its_base(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAPFROG_CACHE", str(tmp_path))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    large = LLM("stories-large-diffusion").generate(["Once upon a time"], params)[0]
    small = LLM("stories-diffusion-plain").generate(["Once upon a time"], params)[0]
    assert large.token_ids == small.token_ids
    assert large.metrics.num_forwards == small.metrics.num_forwards


def test_write_sums_after_the_base_changes(llama_dir, tmp_path, monkeypatch):
    """A retrained base makes the recipe's checksums stale (the build refuses); `python -m
    leapfrog.checkpoint.build --write-sums` rewrites them from a fresh build, which then loads."""
    from leapfrog.checkpoint.build import main as build_main
    monkeypatch.setenv("LEAPFROG_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "ckpts"
    shutil.copytree(llama_dir, root / "base")
    recipe = write_recipe(root, "base")
    assert build_main(["--write-sums", str(recipe)]) == 0
    sums = (recipe / "SHA256SUMS").read_text()
    assert [line.split("  ")[1] for line in sums.splitlines()] == ["model.safetensors", "config.json"]
    assert materialize(recipe).is_dir()
    tensors = load_file(str(root / "base" / "model.safetensors"))      # "retrain" the base
    tensors = {n: t + 0.01 if t.dim() == 2 else t for n, t in tensors.items()}
    save_file(tensors, str(root / "base" / "model.safetensors"))
    (recipe / "README.md").write_text("retrained base\n")              # a new recipe digest: a new build
    with pytest.raises(BuildError, match="model.safetensors does not match"):
        materialize(recipe)
    build_main(["--write-sums", str(recipe)])
    assert (recipe / "SHA256SUMS").read_text() != sums
    built = materialize(recipe)
    assert sha256(built / "model.safetensors") == (recipe / "SHA256SUMS").read_text().split()[0]


def test_a_narrow_drafter_distils_against_the_grown_target_and_ships_in_the_recipe(
        llama_dir, tmp_path, monkeypatch, one_thread):
    """`leapfrog train drafter --target GROWN --init-from NARROW`: the drafter keeps its width,
    taps and frozen embedding and LM head, trains the rest against the grown model, and, shipped
    in the recipe folder (a `copy` drafter), decodes the grown model losslessly."""
    from safetensors.torch import load_file
    from test_speculative import write_drafter

    from leapfrog.train.drafter import DrafterRecipe, train_drafter
    monkeypatch.setenv("LEAPFROG_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "ckpts"
    shutil.copytree(llama_dir, root / "base")
    write_drafter(root / "base" / "drafters" / "dspark", llama_dir, "dspark", num_layers=1, block_size=4)
    recipe = write_recipe(root, "base", {"drafters/dspark": {"from": "base/drafters/dspark", "narrow": True}})
    built = materialize(recipe)
    start = built / "drafters" / "dspark"
    out = recipe / "drafters" / "dspark"                  # trained into the recipe folder itself
    r = DrafterRecipe(name="dspark-markov", target=str(built), kind="dspark", num_layers=1, markov_rank=8,
                      num_draft=4, taps=[9], steps=4, seqs_per_step=2, anchors=8, lr=3e-3, warmup=1,
                      eval_interval=2, ckpt_interval=2, num_regen=6, num_val=3, regen_tokens=20,
                      init_from=str(start), out_dir=str(out), run_dir=str(tmp_path / "run"),
                      command="leapfrog train drafter dspark-markov")
    summary = train_drafter(r)
    taps = json.loads((start / "config.json").read_text())["target_layer_ids"]
    assert summary["narrow"] and r.taps == taps != [9]
    # the taps came from --init-from: the recorded command names them, so it rebuilds this recipe
    recorded = json.loads((out / "training.json").read_text())["recipe"]
    assert recorded["taps"] == taps and recorded["command"].endswith("--taps " + ",".join(map(str, taps)))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["target_hidden_size"] == 2 * cfg["hidden_size"]
    before, after = load_file(str(start / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert torch.equal(before["embed_tokens.weight"], after["embed_tokens.weight"])
    assert torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    assert not torch.equal(before["fc.weight"], after["fc.weight"])
    # shipped in the recipe: the build copies it; dspark on the grown model is still lossless
    from leapfrog.checkpoint.build import main as build_main
    assert build_main(["--ship-drafter", str(recipe), "drafters/dspark"]) == 0
    assert json.loads((recipe / "build.json").read_text())["drafters"] == {
        "drafters/dspark": {"copy": "drafters/dspark", "from": "base/drafters/dspark", "narrow": True}}
    sums = (recipe / "SHA256SUMS").read_text()
    assert "drafters/dspark/model.safetensors" in sums
    rebuilt = materialize(recipe)
    assert load_file(str(rebuilt / "drafters" / "dspark" / "model.safetensors"))["fc.weight"].equal(after["fc.weight"])
    assert not (rebuilt / "drafters" / "dspark" / "SHA256SUMS").exists()
    # `--derived` (make models' start for a retrained drafter): derived again, not the shipped copy;
    # shipping once more keeps the origin
    assert build_main(["--derived", str(recipe), str(tmp_path / "derived")]) == 0
    again = load_file(str(tmp_path / "derived" / "drafters" / "dspark" / "model.safetensors"))
    assert again.keys() == before.keys() and all(torch.equal(again[k], before[k]) for k in before)
    assert build_main(["--ship-drafter", str(recipe), "drafters/dspark"]) == 0
    assert json.loads((recipe / "build.json").read_text())["drafters"]["drafters/dspark"]["from"] == "base/drafters/dspark"
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = ["Once upon a time", "The cat liked to play"]
    want = LLM(str(rebuilt)).generate(prompts, params)
    got = LLM(str(rebuilt), method="dspark", draft_model=str(rebuilt / "drafters" / "dspark")).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
