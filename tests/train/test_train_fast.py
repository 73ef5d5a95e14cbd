"""The training loop's fast path (train.fast) and long-run machinery: the lean forward computes
Hugging Face Llama's loss and gradients, mixed-in sources take their share of the windows, a run
with dropout resumes exactly, the best validation weights are the ones exported, and the run
folder shows its progress."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from leapfrog.layers.rotary import coupled_positions
from leapfrog.train import fast, loop
from leapfrog.train.loop import ModelShape, build_model, draw_windows, loss_on, train
from leapfrog.train.prepare import prepare
from leapfrog.train.recipes import tiny


# data_dir (a miniature copy of the shared data layout) and private_cache (token caches under
# the test's tmp_path) come from conftest.py.
pytestmark = pytest.mark.usefixtures("private_cache")


@pytest.mark.parametrize("kv_heads,tied", [(1, True), (2, False)])
def test_fast_forward_gives_transformers_loss_and_gradients(kv_heads, tied):
    """Oracle: transformers' LlamaForCausalLM on the same parameters (GQA and plain attention,
    tied and untied embeddings)."""
    torch.manual_seed(0)
    model = build_model(ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=kv_heads,
                                   intermediate_size=96, max_position=64, tie_embeddings=tied,
                                   rope_theta=500.0), vocab_size=101)
    assert fast.supported(model)
    x, y = torch.randint(0, 101, (3, 40)), torch.randint(0, 101, (3, 40))
    want = loss_on(model, x, y, "fp32")
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    cos, sin = fast.rope_table(model, 64)
    got = fast.causal_lm_loss(model, x, y, cos, sin)
    got.backward()
    assert torch.allclose(got, want, atol=1e-5)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, want_grads[name], atol=1e-5, rtol=1e-4), name


def test_dropout_is_active_in_training_only():
    torch.manual_seed(0)
    model = build_model(ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                   intermediate_size=64, max_position=32), vocab_size=50)
    x = torch.randint(0, 50, (2, 16))
    cos, sin = fast.rope_table(model, 32)
    model.train()
    a = fast.causal_lm_loss(model, x, x, cos, sin, dropout=0.3)
    b = fast.causal_lm_loss(model, x, x, cos, sin, dropout=0.3)
    assert not torch.equal(a, b)
    model.eval()
    assert torch.equal(fast.causal_lm_loss(model, x, x, cos, sin, dropout=0.3),
                       fast.causal_lm_loss(model, x, x, cos, sin))


def test_mixed_source_takes_its_share_of_windows(data_dir):
    cfg = tiny("stories")
    cfg.data_dir, cfg.batch_size, cfg.mix = str(data_dir), 400, (("classics", 0.3),)
    prep = prepare("stories", cfg.tokenizer, cfg.data_dir, cfg.seed, 64, extra=("classics",))
    extra = np.asarray(prep.extra["classics"])
    main_ids, extra_ids = set(np.asarray(prep.train).tolist()), set(extra.tolist())
    only_extra = extra_ids - main_ids          # pieces of the capitalised words only
    assert len(only_extra) > 5
    x, y = draw_windows(prep, cfg, np.random.default_rng(0))
    from_extra = [bool(set(row.tolist()) & only_extra) for row in x]
    assert 0.2 < np.mean(from_extra) < 0.4
    assert torch.equal(x[:, 1:], y[:, :-1])
    again, _ = draw_windows(prep, cfg, np.random.default_rng(0))
    assert torch.equal(x, again)               # the step's generator decides everything


def _fast_config(data_dir, root: Path, steps: int):
    cfg = tiny("stories", root / "out", root / "run")
    cfg.data_dir, cfg.max_steps, cfg.ckpt_interval, cfg.eval_interval = str(data_dir), steps, 3, 2
    cfg.fast, cfg.dropout, cfg.mix, cfg.keep_best, cfg.save_dtype = True, 0.2, (("classics", 0.5),), True, "float32"
    return cfg


def test_fast_run_with_dropout_and_mix_resumes_exactly_and_exports_the_best(data_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    reference = train(_fast_config(data_dir, tmp_path / "a", 8))
    want = torch.load(tmp_path / "a" / "run" / "state.pt", weights_only=False)
    # The same run stopped after 3 steps, then resumed to 8.
    train(_fast_config(data_dir, tmp_path / "b", 3))
    train(_fast_config(data_dir, tmp_path / "b", 8), resume=True)
    got = torch.load(tmp_path / "b" / "run" / "state.pt", weights_only=False)
    assert got["history"]["train"] == want["history"]["train"]
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    # keep_best: the exported weights are best.pt's, and the summary gives its step and loss.
    best = torch.load(tmp_path / "a" / "run" / "best.pt", weights_only=True)
    vals = dict(want["history"]["val"])
    assert best["val"] == min(vals.values()) and vals[best["step"]] == best["val"]
    assert reference["exported_step"] == best["step"] and reference["val_loss"] == round(best["val"], 4)
    saved = load_file(str(tmp_path / "a" / "out" / "model.safetensors"))
    for name, tensor in saved.items():
        assert torch.equal(tensor, best["model"][name]), name
    progress = json.loads((tmp_path / "a" / "run" / "progress.json").read_text())
    assert progress["step"] == 8 and progress["tokens"] == 8 * 4 * 32
    assert (tmp_path / "a" / "run" / "loss.png").stat().st_size > 1000


def test_a_run_killed_while_averaging_resumes_onto_the_same_mean(data_dir, tmp_path, monkeypatch):
    """average_from with keep_best: a run killed after the averaging began (its state saved at
    step 6, the mean from step 4 on) resumes with the mean it had, and ends with the weights,
    validation and export of the uninterrupted run."""
    from safetensors.torch import load_file

    def config(root):
        cfg = _fast_config(data_dir, root, 8)
        cfg.average_from = 0.5
        return cfg

    train(config(tmp_path / "a"))
    want = torch.load(tmp_path / "a" / "run" / "state.pt", weights_only=False)
    assert want["history"]["averaged_steps"] == 5 and want["average"]["count"] == 5
    save = loop.save_state

    def killed_after_six(run_dir, model, opt, step, history, average=None):
        save(run_dir, model, opt, step, history, average)
        if step == 6:
            raise KeyboardInterrupt("killed")
    monkeypatch.setattr(loop, "save_state", killed_after_six)
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path / "b"))
    assert torch.load(tmp_path / "b" / "run" / "state.pt", weights_only=False)["average"]["count"] == 3
    monkeypatch.setattr(loop, "save_state", save)
    train(config(tmp_path / "b"), resume=True)
    got = torch.load(tmp_path / "b" / "run" / "state.pt", weights_only=False)
    assert got["history"]["val"] == want["history"]["val"]
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    a, b = (load_file(str(tmp_path / x / "out" / "model.safetensors")) for x in "ab")
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_unlikelihood_matches_its_definition():
    """Against a loop over positions: at t the candidates are the distinct inputs 0..t other than
    target t, each adding -log(1 - p)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 7, 11)
    ids = torch.tensor([[3, 5, 3, 7, 7, 1, 2], [4, 4, 4, 4, 9, 0, 4]])
    targets = torch.tensor([[5, 3, 7, 7, 1, 3, 2], [4, 4, 4, 9, 0, 4, 10]])
    p = logits.softmax(-1)
    want = 0.0
    for b in range(2):
        for t in range(7):
            for c in set(ids[b, :t + 1].tolist()) - {int(targets[b, t])}:
                want -= math.log(1 - float(p[b, t, c]))
    want /= 2 * 7
    assert fast.unlikelihood(logits, ids, targets).item() == pytest.approx(want, rel=1e-5)
    # a window of one repeated token that is also every target has no candidates at all
    same = torch.full((1, 5), 4)
    assert fast.unlikelihood(torch.randn(1, 5, 11), same, same).item() == 0.0


def test_unlikelihood_run_trains_and_validation_reports_cross_entropy(data_dir, tmp_path):
    """A run with the unlikelihood term: it trains (the logged parts), validation is the plain
    cross-entropy (what evaluate gives without the term), and it needs the fast forward."""
    from leapfrog.train.loop import FastNextToken, _model_and_tokenizer, evaluate, training_data

    cfg = _fast_config(data_dir, tmp_path / "ul", 4)
    cfg.unlikelihood, cfg.keep_best, cfg.mix = 1.0, False, ()
    train(cfg)
    state = torch.load(tmp_path / "ul" / "run" / "state.pt", weights_only=False)
    prep = training_data(cfg)
    model, _ = _model_and_tokenizer(cfg, prep)
    model.load_state_dict(state["model"])
    plain = _fast_config(data_dir, tmp_path / "plain", 4)
    val_ul, _ = evaluate(model, prep.val, cfg, FastNextToken(model, cfg))
    val_plain, _ = evaluate(model, prep.val, plain, FastNextToken(model, plain))
    assert val_ul == val_plain and dict(state["history"]["val"])[4] == pytest.approx(val_ul)
    objective = FastNextToken(model, cfg)
    model.train()
    x, y = draw_windows(prep, cfg, np.random.default_rng(0))
    total, parts = objective.loss(model, (x, y), "float32")
    assert parts["unlikelihood"] > 0 and total.item() == pytest.approx(parts["ce"] + parts["unlikelihood"], rel=1e-5)
    slow = tiny("stories", tmp_path / "out", tmp_path / "run")
    slow.data_dir, slow.unlikelihood = str(data_dir), 1.0
    with pytest.raises(ValueError, match="fast forward"):
        train(slow)


def test_dropout_without_the_fast_forward_is_refused(data_dir, tmp_path):
    cfg = tiny("stories", tmp_path / "out", tmp_path / "run")
    cfg.data_dir, cfg.dropout = str(data_dir), 0.1
    with pytest.raises(ValueError, match="fast forward"):
        train(cfg)


def _grown_recipe(data_dir, tmp_path: Path) -> Path:
    """A tiny stories model trained for a few steps (the base, with the data's tokenizer) and a
    recipe folder growing it 2x wider and 2x deeper."""
    root = tmp_path / "ckpts"
    cfg = tiny("stories", root / "base", tmp_path / "base-run")
    cfg.data_dir, cfg.max_steps = str(data_dir), 4
    train(cfg)
    recipe = root / "grown"
    recipe.mkdir()
    (recipe / "build.json").write_text(json.dumps({"base": "base", "width": 2, "depth": 2, "delta": None}))
    return recipe


def _lora_config(data_dir, recipe: Path, run: Path, steps: int):
    from leapfrog.train.large import LoraSpec
    cfg = tiny("stories", recipe, run)
    cfg.data_dir, cfg.max_steps, cfg.eval_interval, cfg.ckpt_interval = str(data_dir), steps, 2, 2
    cfg.lr, cfg.fast, cfg.keep_best = 1e-2, True, True
    cfg.lora = LoraSpec(recipe=str(recipe), rank=4, noise=1e-2)
    return cfg


def test_low_rank_run_ships_a_delta_that_the_recipe_builds(data_dir, tmp_path, monkeypatch):
    """Oracle: the trained model in memory. The recipe, built with the exported delta, gives its
    logits (float16 rounding); the export is never worse than step 0; the frozen weights are not
    in the run's state; a resumed run equals an uninterrupted one."""
    from safetensors.torch import load_file

    from transformers import LlamaForCausalLM

    from leapfrog.checkpoint.build import materialize, sha256
    from leapfrog.train import large
    monkeypatch.setenv("LEAPFROG_CACHE", str(tmp_path / "cache"))
    recipe = _grown_recipe(data_dir, tmp_path)
    summary = train(_lora_config(data_dir, recipe, tmp_path / "run", 6))
    state = torch.load(tmp_path / "run" / "state.pt", weights_only=False)
    assert state["model"] and all(".lora_" in n for n in state["model"])
    vals = dict(state["history"]["val"])
    assert 0 in vals and summary["val_loss"] <= round(vals[0], 4)
    assert json.loads((recipe / "build.json").read_text())["delta"] == large.DELTA_FILE
    delta = load_file(str(recipe / large.DELTA_FILE))
    assert summary["delta"]["parameters"] == sum(t.numel() for t in delta.values())
    # the copies have drifted apart: B's rows for the two copies of a unit differ
    b = delta["model.layers.0.mlp.down_proj.weight.lora_B"].float()
    half = b.shape[0] // 2
    assert not torch.allclose(b[:half], b[half:])
    # the recipe now builds the trained model: its logits are the in-memory model's
    built = materialize(recipe)
    assert sha256(built / "model.safetensors") == (recipe / "SHA256SUMS").read_text().split()[0]
    model, _ = large.grown_model(large.LoraSpec(recipe=str(recipe), rank=4))
    ids = torch.tensor([[1, 40, 33, 95, 120, 7, 8, 9]])
    with torch.no_grad():
        start = model(ids).logits[0]
    large.add_low_rank(model, large.LoraSpec(recipe=str(recipe), rank=4), 0)
    best = torch.load(tmp_path / "run" / "best.pt", weights_only=True)["model"]
    model.load_state_dict({n: t.to(torch.float16).float() for n, t in best.items()}, strict=False)
    with torch.no_grad():
        want = model(ids).logits[0]
    assert (want - start).abs().max() > 0.1           # training moved the function (5x the tolerance below)
    hf = LlamaForCausalLM.from_pretrained(str(built), dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits[0], want, atol=2e-2)
    # resume: 3 steps, then on to 6, equals the 6-step run
    recipe2 = _grown_recipe(data_dir, tmp_path / "again")
    train(_lora_config(data_dir, recipe2, tmp_path / "run2", 3))
    train(_lora_config(data_dir, recipe2, tmp_path / "run2", 6), resume=True)
    again = torch.load(tmp_path / "run2" / "state.pt", weights_only=False)
    assert again["history"]["train"] == state["history"]["train"]
    # a retrained base: resuming the old run would mix two parents, so it is refused
    from safetensors.torch import save_file
    base = large.base_folder(large.LoraSpec(recipe=str(recipe2)))
    weights = load_file(str(base / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    save_file(weights, str(base / "model.safetensors"))
    with pytest.raises(ValueError, match="retrained"):
        train(_lora_config(data_dir, recipe2, tmp_path / "run2", 8), resume=True)


def test_a_stopped_process_counts_as_paused_not_as_training():
    from leapfrog.train.loop import StepClock
    clock, history = StepClock(), {}
    # compilation first (never judged), then 1-second steps, a 10-minute stop, more steps
    seconds = [clock.training_seconds(dt, history) for dt in [90.0, 1.0, 1.0, 1.0, 1.0, 600.0, 1.0, 30.0]]
    assert seconds[:5] == [90.0, 1.0, 1.0, 1.0, 1.0]
    assert seconds[5] == pytest.approx(1.0) and history["paused_s"] == pytest.approx(599.0)
    assert seconds[6] == 1.0 and seconds[7] == 30.0      # a slow step under a minute is training


def test_coupled_positions_restart_after_the_first_anchor_of_each_example():
    bos, sep, eos = 1, 5, 2
    x = torch.tensor([[9, 9, bos, 10, 11, 12, sep, 20, 21, 22, eos, bos, 30, sep, 40, sep, 41]])
    want = [0, 1, 0, 1, 2, 3, 4, 1, 2, 3, 4, 0, 1, 2, 1, 2, 3]
    assert coupled_positions(x, bos, sep).tolist() == [want]
    # the fast forward at those positions is transformers' forward given them as position_ids
    torch.manual_seed(0)
    model = build_model(ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                   intermediate_size=96, max_position=64), vocab_size=101)
    x = torch.randint(6, 101, (2, 30))
    x[:, [0, 12]], x[:, [5, 20]] = bos, sep
    y = torch.randint(0, 101, (2, 30))
    pos = coupled_positions(x, bos, sep)
    logits = model(input_ids=x, position_ids=pos).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 101), y.reshape(-1))
    cos, sin = fast.rope_table(model, 64)
    assert torch.allclose(fast.causal_lm_loss(model, x, y, cos, sin, 0.0, pos), want, atol=1e-5)
    coupled = model.lm_head(fast.hidden_states(model, x, cos, sin, 0.0, pos))
    plain = model.lm_head(fast.hidden_states(model, x, cos, sin))
    assert torch.allclose(coupled, logits, atol=1e-5)
    assert not torch.allclose(plain[:, 13:], logits[:, 13:], atol=1e-3)     # where they differ


def test_a_coupled_run_trains_and_declares_its_positions(data_dir, tmp_path):
    cfg = _fast_config(data_dir, tmp_path / "cp", 2)
    cfg.coupled_positions, cfg.mix = "<mask>", ()
    summary = train(cfg)
    assert json.loads((tmp_path / "cp" / "out" / "leapfrog.json").read_text()) == {"coupled_positions": "<mask>"}
    from leapfrog.train.check import CheckResult
    from leapfrog.train.readme import render
    text = render(summary, CheckResult("stories"), tmp_path / "cp" / "out")
    assert "## Positions" in text and "restart after the first `<mask>`" in text
