"""Drafter distillation (leapfrog train drafter) on a tiny random target: the loss falls, the
export is the published layout and loads into the speculative methods unchanged, offline τ
means what it says, and calibration lowers the confidence head's calibration error."""
from __future__ import annotations

import json
import math

import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.models.loader import load_model, read_config
from leapfrog.methods.drafters import load_drafter
from leapfrog.train.drafter import (Distiller, DrafterRecipe, calibrate, drafter_config, hf_state_dict,
                                    init_drafter, mask_token_id, train_drafter)

TINY = dict(num_layers=1, markov_rank=8, num_draft=4, taps=[0, 1], steps=6, seqs_per_step=2, anchors=8,
            lr=3e-3, warmup=1, eval_interval=3, ckpt_interval=3, num_regen=6, num_val=3, regen_tokens=20)


def _setup(llama_dir, tmp_path, kind: str, head: str = "vanilla"):
    r = DrafterRecipe(name=f"{kind}-{head}", target=str(llama_dir), kind=kind, head=head,
                      out_dir=str(tmp_path / "out"), run_dir=str(tmp_path / "run"), **TINY)
    target = load_model(llama_dir).requires_grad_(False)
    drafter = init_drafter(drafter_config(r, read_config(llama_dir), mask_token_id(llama_dir)), 0, target)
    return r, Distiller(r, target, drafter)


def _sequence(llama_dir) -> dict:
    out = LLM(str(llama_dir)).generate(["Once upon a time"], SamplingParams(max_tokens=24, temperature=0,
                                                                            ignore_eos=True))[0]
    return {"ids": out.prompt_token_ids + out.token_ids, "start": len(out.prompt_token_ids), "greedy": True}


def _assert_dspark_decodes_as_ar(llama_dir, drafter_folder) -> None:
    """Greedy `dspark` with the drafter in `drafter_folder` gives `ar`'s tokens (lossless)."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = ["Once upon a time", "The cat liked to play"]
    want = [o.token_ids for o in LLM(str(llama_dir)).generate(prompts, params)]
    got = LLM(str(llama_dir), method="dspark", draft_model=str(drafter_folder)).generate(prompts, params)
    assert [o.token_ids for o in got] == want


@pytest.mark.parametrize("kind,head", [("dflash", "vanilla"), ("dspark", "vanilla"), ("dspark", "rnn")])
def test_distillation_loss_falls_on_a_repeated_sequence(llama_dir, tmp_path, one_thread, kind, head):
    r, d = _setup(llama_dir, tmp_path, kind, head)
    seq = _sequence(llama_dir)
    opt = torch.optim.AdamW(d.drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        out = d.loss(seq, torch.Generator().manual_seed(0))    # same anchors every step
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(out["loss"].item())
    assert losses[-1] < 0.7 * losses[0], losses
    if kind == "dspark":
        assert {"ce", "tv", "conf"} <= set(out)


def test_offline_tau_counts_the_drafts_the_target_would_accept(llama_dir, tmp_path, one_thread):
    r, d = _setup(llama_dir, tmp_path, "dspark")
    seq = _sequence(llama_dir)
    acc, conf = d.drafted_paths([seq], stride=1)
    assert acc.numel() == conf.shape[0] > 0 and conf.shape[1] == d.gamma
    assert bool(((acc >= 0) & (acc <= d.gamma)).all())
    # Recount one block by hand: argmax drafts along the drafted path vs the greedy sequence.
    from leapfrog.models.dflash_heads import sample_block
    from leapfrog.train.drafter_objectives import forward_blocks
    ids = torch.tensor(seq["ids"])
    a = torch.tensor([seq["start"] - 1])
    feats, _ = d.target_pass(ids)
    with torch.no_grad():
        hidden = forward_blocks(d.drafter, feats, d.embed, ids, a)
        drafts, _, _ = sample_block(d.target.compute_logits(hidden), hidden, ids[a], d.drafter.markov_head,
                                    None, lambda x: x.argmax(-1))
    n = 0
    while n < d.gamma and int(drafts[0, n]) == int(ids[a + 1 + n]):
        n += 1
    assert int(acc[0]) == n


def test_calibration_lowers_the_first_position_error(llama_dir, tmp_path, one_thread):
    r, d = _setup(llama_dir, tmp_path, "dspark")
    with torch.no_grad():                      # an over-confident head: every draft "survives"
        d.drafter.confidence_head.proj.bias.fill_(4.0)
    res = calibrate(d, [_sequence(llama_dir)])
    assert len(res["temperatures"]) == d.gamma
    assert res["ece_after"][0] <= res["ece_before"][0]


def test_export_round_trips_through_the_published_loader(llama_dir, tmp_path, one_thread):
    for kind in ("dflash", "dspark"):
        r, d = _setup(llama_dir, tmp_path / kind, kind)
        state = hf_state_dict(d.drafter)
        assert "layers.0.self_attn.q_proj.weight" in state and "layers.0.mlp.up_proj.weight" in state
        assert not any("qkv_proj" in k or "gate_up" in k for k in state)
        from safetensors.torch import save_file
        out = tmp_path / kind / "export"
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps(drafter_config(r, read_config(llama_dir), 3)))
        save_file(state, str(out / "model.safetensors"))
        loaded = load_drafter(out)
        want = {k: v.float() for k, v in state.items()}
        assert hf_state_dict(loaded).keys() == want.keys()
        for k, v in hf_state_dict(loaded).items():
            assert torch.equal(v.float(), want[k]), k


def test_train_drafter_end_to_end_writes_a_usable_lossless_drafter(llama_dir, tmp_path, one_thread):
    r = DrafterRecipe(name="dspark-markov", target=str(llama_dir), kind="dspark",
                      out_dir=str(tmp_path / "out"), run_dir=str(tmp_path / "run"), **TINY)
    s = train_drafter(r)
    assert 1.0 <= s["offline_tau"] <= 1 + r.num_draft
    assert len(s["acceptance_by_position"]) == r.num_draft and "draft k accepted" in (tmp_path / "out" / "README.md").read_text()
    assert s["calibration"] and len(s["calibration"]["temperatures"]) == r.num_draft
    out = tmp_path / "out"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["block_size"] == r.num_draft
    assert len(cfg["confidence_temperatures"]) == r.num_draft
    assert {"README.md", "loss.png", "SHA256SUMS", "training.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    # Resuming a finished run trains nothing more and gives the same summary.
    again = train_drafter(r, resume=True)
    assert again["steps"] == s["steps"]
    # ... but not against a target whose weights changed since (a retrained target)
    import dataclasses
    import shutil
    from safetensors.torch import load_file, save_file
    other = tmp_path / "retrained"
    shutil.copytree(llama_dir, other)
    weights = load_file(str(other / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    save_file(weights, str(other / "model.safetensors"))
    with pytest.raises(ValueError, match="retrained"):
        train_drafter(dataclasses.replace(r, target=str(other), steps=r.steps + 3), resume=True)
    _assert_dspark_decodes_as_ar(llama_dir, out)


def test_init_from_continues_a_saved_drafter(llama_dir, tmp_path, one_thread):
    """DrafterRecipe.init_from: the run starts from the saved drafter's weights (zero steps give
    them back unchanged), and a folder of another shape is refused naming the folder."""
    from safetensors.torch import load_file

    r = DrafterRecipe(name="dspark-markov", target=str(llama_dir), kind="dspark",
                      out_dir=str(tmp_path / "first"), run_dir=str(tmp_path / "run1"), **TINY)
    train_drafter(r)
    again = DrafterRecipe(name="dspark-markov", target=str(llama_dir), kind="dspark",
                          out_dir=str(tmp_path / "second"), run_dir=str(tmp_path / "run2"),
                          init_from=str(tmp_path / "first"), **{**TINY, "steps": 0})
    train_drafter(again)
    first, second = load_file(str(tmp_path / "first" / "model.safetensors")), load_file(str(tmp_path / "second" / "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert "continuing" in (tmp_path / "second" / "README.md").read_text()
    other = DrafterRecipe(name="dspark-rnn", target=str(llama_dir), kind="dspark", head="rnn",
                          out_dir=str(tmp_path / "third"), run_dir=str(tmp_path / "run3"),
                          init_from=str(tmp_path / "first"), **TINY)
    with pytest.raises(ValueError, match="first"):
        train_drafter(other)


def test_init_noise_breaks_copies_and_zero_noise_keeps_the_start(llama_dir, tmp_path, one_thread):
    """DrafterRecipe.init_noise: the starting drafter's matrices move by about that share of their
    own spread, so a unit's exact copies (a drafter grown wider, leapfrog.checkpoint.build) stop being
    copies; the frozen tables stay as given; it needs init_from."""
    from leapfrog.train.drafter import break_symmetry

    r, d = _setup(llama_dir, tmp_path, "dspark")
    fc = d.drafter.fc.weight
    with torch.no_grad():
        fc[1::2] = fc[0::2]                     # every unit copied, as Net2Net growth leaves them
    before = {k: v.clone() for k, v in d.drafter.state_dict().items()}
    break_symmetry(d.drafter, 1e-3, 0)
    assert not torch.equal(fc[1::2], fc[0::2])
    change = (fc.detach() - before["fc.weight"]).std() / before["fc.weight"].std()
    assert 5e-4 < float(change) < 2e-3
    for k, v in d.drafter.state_dict().items():
        if v.dim() < 2:
            assert torch.equal(v, before[k]), k      # norms, biases: unchanged
    with pytest.raises(ValueError, match="init_noise"):
        DrafterRecipe(name="x", init_noise=1e-3, out_dir="o", run_dir="r")
    with pytest.raises(ValueError, match="init_noise"):
        DrafterRecipe(name="x", init_noise=-1.0, init_from="f", out_dir="o", run_dir="r")


def test_bfloat16_training_steps_track_float32(llama_dir, tmp_path, one_thread, monkeypatch):
    """--dtype bf16 (autocast, float32 master weights): the loss of the same blocks is float32's
    up to bfloat16 rounding, the training steps run under it and lower the loss, the weights stay
    float32, and the run records its precision."""
    r, d = _setup(llama_dir, tmp_path, "dspark")
    seq = _sequence(llama_dir)
    with torch.no_grad():
        exact = float(d.loss(seq, torch.Generator().manual_seed(0))["loss"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            rounded = float(d.loss(seq, torch.Generator().manual_seed(0))["loss"])
    assert abs(rounded - exact) < 0.02 * exact
    import dataclasses
    seen = []                                   # was bfloat16 autocast on in each loss computed?
    real_loss = Distiller.loss

    def spy(self, *args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        return real_loss(self, *args, **kwargs)
    monkeypatch.setattr(Distiller, "loss", spy)
    run = dataclasses.replace(r, dtype="bf16", steps=8, eval_interval=8, ckpt_interval=8)
    s = train_drafter(run)
    steps = run.steps * run.seqs_per_step
    assert seen[:steps] == [True] * steps       # every training step's loss under bfloat16 autocast
    assert not any(seen[steps:])                # validation in float32
    assert s["recipe"]["dtype"] == "bf16" and math.isfinite(s["val_loss"])
    history = torch.load(tmp_path / "run" / "state.pt", weights_only=False)["history"]["train"]
    assert history[-1][1] < history[0][1]
    state = torch.load(tmp_path / "run" / "state.pt", weights_only=False)["model"]
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    from leapfrog.train.drafter import recipe_for
    assert recipe_for(["dspark-markov-2l", "--dtype", "bf16"])[0].dtype == "bf16"
    with pytest.raises(ValueError, match="dtype"):
        DrafterRecipe(name="x", dtype="fp16", out_dir="o", run_dir="r")


def test_acceptance_by_position_is_conditional_on_the_drafts_before():
    """Blocks that accepted 0, 1, 1, 2 and 3 leading drafts of 3: draft 1 held in 4 of 5 blocks,
    draft 2 in 2 of those 4, draft 3 in 1 of those 2; a position no block reached is NaN."""
    from leapfrog.train.drafter import acceptance_by_position
    got = acceptance_by_position(torch.tensor([0, 1, 1, 2, 3]), 3)
    assert got == [4 / 5, 2 / 4, 1 / 2]
    assert acceptance_by_position(torch.tensor([0, 0]), 2)[0] == 0.0
    assert math.isnan(acceptance_by_position(torch.tensor([0, 0]), 2)[1])


def test_dspark_on_the_masks_block_drafts_as_dflash_without_its_head(llama_dir, tmp_path, one_thread):
    """`--block masks`: a DSpark drafter on DFlash's block (the anchor and γ masks, draft 1 from
    the first mask's slot). Its config says so (block γ + 1, draft_from_anchor false); with DFlash's
    weights and the Markov bias at zero it drafts exactly what the DFlash drafter does; its loss
    falls; and the engine decodes with it losslessly."""
    from safetensors.torch import save_file

    _, flash = _setup(llama_dir, tmp_path / "flash", "dflash")
    r = DrafterRecipe(name="dspark-masks", target=str(llama_dir), kind="dspark", block="masks",
                      out_dir=str(tmp_path / "out"), run_dir=str(tmp_path / "run"), **TINY)
    cfg = drafter_config(r, read_config(llama_dir), mask_token_id(llama_dir))
    assert cfg["block_size"] == r.num_draft + 1 and cfg["draft_from_anchor"] is False
    target = load_model(llama_dir).requires_grad_(False)
    masks = Distiller(r, target, init_drafter(cfg, 0, target))
    assert masks.gamma == r.num_draft == masks.drafter.drafter.num_draft_tokens
    missing = masks.drafter.load_state_dict(flash.drafter.state_dict(), strict=False).missing_keys
    assert missing and all(k.startswith(("markov_head.", "confidence_head.")) for k in missing)
    with torch.no_grad():
        masks.drafter.markov_head.markov_w2.weight.zero_()
    seq = _sequence(llama_dir)
    assert torch.equal(masks.drafted_paths([seq], stride=1)[0], flash.drafted_paths([seq], stride=1)[0])
    anchor_cfg = drafter_config(DrafterRecipe(**{**TINY, "kind": "dspark"}, target=str(llama_dir)),
                                read_config(llama_dir), 3)
    assert anchor_cfg["block_size"] == r.num_draft and "draft_from_anchor" not in anchor_cfg

    masks.drafter.markov_head.markov_w2.weight.data.normal_(std=0.02)
    opt = torch.optim.AdamW(masks.drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        out = masks.loss(seq, torch.Generator().manual_seed(0))
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(out["loss"].item())
    assert losses[-1] < 0.7 * losses[0], losses

    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(hf_state_dict(masks.drafter), str(folder / "model.safetensors"))
    assert load_drafter(folder).drafter.num_draft_tokens == r.num_draft
    _assert_dspark_decodes_as_ar(llama_dir, folder)


def test_heads_from_starts_a_dspark_drafter_from_a_dflash_backbone(llama_dir, tmp_path, one_thread):
    """--init-from a DFlash drafter and --heads-from a DSpark one: a DSpark drafter on DFlash's
    block whose backbone is the first's and whose Markov and confidence heads are the second's
    (zero steps give exactly those); heads from a drafter without them are refused, naming it."""
    from safetensors.torch import load_file, save_file

    folders = {}
    for kind in ("dflash", "dspark"):
        r, d = _setup(llama_dir, tmp_path / kind, kind)
        d.drafter.requires_grad_(False)
        for p in d.drafter.parameters():       # distinct weights, so the origin of each shows
            p.add_(torch.randn_like(p) * 0.01)
        folders[kind] = tmp_path / kind / "export"
        folders[kind].mkdir(parents=True)
        (folders[kind] / "config.json").write_text(json.dumps(drafter_config(r, read_config(llama_dir), 3)))
        save_file(hf_state_dict(d.drafter), str(folders[kind] / "model.safetensors"))
    r = DrafterRecipe(name="dspark-masks", target=str(llama_dir), kind="dspark", block="masks",
                      out_dir=str(tmp_path / "out"), run_dir=str(tmp_path / "run"), init_from=str(folders["dflash"]),
                      heads_from=str(folders["dspark"]), **{**TINY, "steps": 0})
    train_drafter(r)
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    flash, spark = (load_file(str(folders[k] / "model.safetensors")) for k in ("dflash", "dspark"))
    heads = [k for k in got if k.startswith(("markov_head.", "confidence_head."))]
    assert heads and set(got) == set(flash) | set(heads)
    assert all(torch.equal(got[k], spark[k]) for k in heads)
    assert all(torch.equal(got[k], flash[k]) for k in flash)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["draft_from_anchor"] is False
    # Continuing it without --block keeps it on DFlash's block (the recorded command says so).
    again = DrafterRecipe(name="dspark-masks", target=str(llama_dir), kind="dspark", out_dir=str(tmp_path / "again"),
                          run_dir=str(tmp_path / "run3"), init_from=str(tmp_path / "out"), command="x",
                          **{**TINY, "steps": 0})
    train_drafter(again)
    assert again.block == "masks" and again.command.endswith("--block masks")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["block_size"] == r.num_draft + 1
    assert torch.equal(load_file(str(tmp_path / "again" / "model.safetensors"))["markov_head.markov_w2.weight"],
                       spark["markov_head.markov_w2.weight"])
    from leapfrog.train.drafter import recipe_for
    with pytest.raises(SystemExit):       # refused before any data is regenerated
        recipe_for(["dspark-markov-2l", "--heads-from", str(folders["dspark"])])
    with pytest.raises(SystemExit):
        recipe_for(["dflash-2l", "--init-from", str(folders["dflash"]), "--heads-from", str(folders["dspark"])])
    import dataclasses
    with pytest.raises(ValueError, match="not a DSpark drafter"):
        train_drafter(dataclasses.replace(r, heads_from=str(folders["dflash"]), run_dir=str(tmp_path / "run2")))


@pytest.mark.parametrize("flags, message", [
    (["--steps", "-1"], "steps=-1: must be an integer >= 0"),
    (["--num-draft", "0"], "num_draft=0: must be a positive integer"),
    (["--lr", "0"], "lr=0.0: must be a positive number"),
    (["--taps", "0,-2"], "must be target layer ids"),
    (["--taps", "x"], "invalid literal"),                       # once a traceback
])
def test_drafter_flags_out_of_range_are_usage_errors(flags, message, capsys):
    from leapfrog.train.drafter import recipe_for
    with pytest.raises(SystemExit) as e:
        recipe_for(["dspark-markov-2l"] + flags)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_flags_for_a_drafter_of_an_instruction_model_reach_the_recipe():
    from leapfrog.train.drafter import recipe_for
    r, _ = recipe_for(["dspark-markov-2l", "--target", "smollm2", "--prompts", "chat", "--layers", "1",
                       "--intermediate-size", "1024", "--regen-tokens", "200", "--ckpt-interval", "20",
                       "--taps", "2,15,28"])
    assert (r.prompts, r.num_layers, r.intermediate_size, r.regen_tokens, r.ckpt_interval, r.taps) == \
        ("chat", 1, 1024, 200, 20, [2, 15, 28])
    cfg = drafter_config(r, {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                             "num_hidden_layers": 30}, 16)
    assert cfg["intermediate_size"] == 1024 and cfg["num_hidden_layers"] == 1 and cfg["mask_token_id"] == 16
    with pytest.raises(ValueError, match="prompts"):
        DrafterRecipe(prompts="poems")
