"""Drafter distillation pieces on toy sizes: labels/anchors, losses, a teacher-forced DSpark
step that learns, and training blocks that see exactly what serving shows the drafter."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from leapfrog.models.loader import load_model
from leapfrog.methods.drafters import load_drafter
from leapfrog.models.dflash import DraftContext
from leapfrog.train.drafter_objectives import (block_labels, dflash_loss, dspark_loss, forward_blocks,
                                                position_weights, sample_anchors, teacher_forced_heads)

pytestmark = pytest.mark.usefixtures("one_thread")


LR, STEPS = 0.5, 20
sys.path.insert(0, str(Path(__file__).parent))
from test_speculative import write_drafter  # noqa: E402


@pytest.fixture(scope="module")
def toy(llama_dir, tmp_path_factory):
    target = load_model(llama_dir).requires_grad_(False)
    drafter = load_drafter(write_drafter(tmp_path_factory.mktemp("toy") / "d", llama_dir, "dspark",
                                         num_layers=1, block_size=4, head="rnn"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 300, (40,), generator=g)
    with torch.no_grad():
        hidden, caps = target.forward(ids[None], torch.arange(ids.numel())[None], None, (0, 1))
    return target, drafter, ids, torch.cat(caps, -1)[0], target.compute_logits(hidden)[0]


def test_anchors_labels_and_weights():
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 0, 1, 1])
    anchors = sample_anchors(mask, 10)
    assert anchors.tolist() == [2, 3, 4, 7]
    labels, valid = block_labels(torch.arange(9) * 10, mask, anchors, 3)
    assert labels[0].tolist() == [30, 40, 50]
    assert valid.tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 0, 0]]
    assert torch.allclose(position_weights(3, 4.0), torch.tensor([1.0, 0.7788, 0.6065]), atol=1e-4)
    assert len(sample_anchors(torch.ones(100), 7, torch.Generator().manual_seed(1))) == 7


def test_losses_vanish_when_the_draft_is_the_target():
    logits = torch.randn(2, 3, 11)
    labels, valid = logits.argmax(-1), torch.ones(2, 3, dtype=torch.bool)
    w = position_weights(3, 3.0)
    parts = dspark_loss(logits, logits, torch.full((2, 3), 20.0), labels, valid, w)
    assert parts["tv"] < 1e-6 and parts["conf"] < 1e-6
    assert torch.isclose(parts["ce"], dflash_loss(logits, labels, valid, w))


def test_training_blocks_match_what_serving_shows_the_drafter(toy):
    _, drafter, ids, feats, _ = toy
    embed = torch.randn(384, 64)
    anchors = torch.tensor([5, 17, 30])
    with torch.no_grad():
        train = forward_blocks(drafter, feats, embed, ids, anchors)
        for i, a in enumerate(anchors.tolist()):
            ctx = DraftContext(0)
            drafter.extend_context(ctx, feats[:a])
            block = torch.full((1, 4), drafter.drafter.mask_token_id)
            block[0, 0] = ids[a]
            serve = drafter.forward(torch.nn.functional.embedding(block, embed), torch.tensor([a]), [ctx])
            torch.testing.assert_close(train[i], serve[0], atol=1e-5, rtol=1e-5)


def test_a_few_teacher_forced_dspark_steps_reduce_the_loss(toy):
    target, drafter, ids, feats, target_logits = toy
    mask = torch.ones_like(ids)
    anchors = sample_anchors(mask, 12, torch.Generator().manual_seed(0))
    gamma = drafter.drafter.num_draft_tokens
    labels, valid = block_labels(ids, mask, anchors, gamma)
    rows = (anchors.unsqueeze(1) + torch.arange(gamma)).clamp(max=ids.numel() - 1)
    t_logits = target_logits[rows]                          # target's distribution of token a + j
    prev = torch.cat([ids[anchors].unsqueeze(1), labels[:, :-1]], 1)
    weights = position_weights(gamma, 4.0)
    losses = _train(target, drafter, ids, feats, anchors, labels, valid, t_logits, prev, weights)
    assert losses[-1] < 0.8 * losses[0], losses
    assert drafter.markov_head.joint_proj.weight.grad is not None
    assert drafter.confidence_head.proj.weight.grad is not None and drafter.fc.weight.grad is not None


def _train(target, drafter, ids, feats, anchors, labels, valid, t_logits, prev, weights) -> list[float]:
    params = [p for p in drafter.parameters() if p.requires_grad]
    losses = []
    for _ in range(STEPS):
        hidden = forward_blocks(drafter, feats, target.model.embed_tokens.weight, ids, anchors)
        base = target.compute_logits(hidden)
        logits, conf = teacher_forced_heads(base, hidden, prev, drafter.markov_head, drafter.confidence_head)
        parts = dspark_loss(logits, t_logits, conf, labels, valid, weights)
        for p in params:
            p.grad = None
        parts["loss"].backward()
        with torch.no_grad():      # plain SGD: torch.optim's first import costs seconds
            for p in params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)
        losses.append(float(parts["loss"].detach()))
    return losses


def test_sequential_temperature_scaling_recovers_the_true_temperature():
    from leapfrog.train.drafter_objectives import expected_calibration_error, fit_sequential_temperatures
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6000, 3, generator=g) * 2.5            # overconfident head: true c = σ(z / 2)
    accepted = torch.rand(6000, 3, generator=g) < torch.sigmoid(z / 2)
    survived = accepted.to(torch.int64).cumprod(1).bool()
    temps = fit_sequential_temperatures(z, survived)
    assert all(1.5 < t < 2.7 for t in temps), temps
    raw = expected_calibration_error(torch.sigmoid(z).cumprod(1)[:, 2], survived[:, 2])
    fitted = torch.sigmoid(z / torch.tensor(temps)).cumprod(1)[:, 2]
    assert expected_calibration_error(fitted, survived[:, 2]) < raw / 3


def test_fitted_temperatures_load_with_the_drafter(llama_dir, tmp_path):
    import json
    folder = write_drafter(tmp_path / "d", llama_dir, "dspark", block_size=3)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["confidence_temperatures"] = [1.5, 2.0, 3.0]
    (folder / "config.json").write_text(json.dumps(cfg))
    head = load_drafter(folder).confidence_head
    h, e = torch.randn(2, 64), torch.randn(2, 8)
    logit = head.proj.forward(torch.cat([h, e], -1)).squeeze(-1)
    torch.testing.assert_close(head.forward(h, e, 1), torch.sigmoid(logit / 2.0))
