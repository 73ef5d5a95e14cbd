"""`leapfrog train drafter`: distil a DFlash or DSpark drafter from a target model (DFlash;
DSpark; the DeepSpec reference code for the training details).
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from leapfrog.train.drafter_recipe import VARIANTS, DrafterRecipe  # noqa: F401  (importable from here)
from leapfrog.train.drafter_data import load_data, regenerate  # noqa: F401  (importable from here)
from leapfrog.train.precision import TRAIN_DTYPES, autocast
from leapfrog.train.drafter_export import (NARROW_KEYS, drafter_config, export, hf_state_dict,  # noqa: F401
                                           mask_token_id, render_readme)


# --- the drafter ----------------------------------------------------------------------------
def init_drafter(cfg: dict, seed: int, target=None):
    """A fresh drafter: Linear weights N(0, 0.02), norms 1, Markov tables small; the final norm
    starts as the target's, so the shared LM head sees hidden states of the scale it knows
    (with a unit norm the initial logits are so peaked that the CE starts near 40 nats)."""
    # deferred: the drafter model code loads only when a drafter is built
    from leapfrog.models.dflash import DFlashDraftModel

    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg)
    for name, p in model.named_parameters():
        if "norm" in name:
            torch.nn.init.ones_(p)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)
        else:
            torch.nn.init.normal_(p, std=0.02)
    if model.confidence_head is not None:      # start near "half the drafts survive"
        torch.nn.init.zeros_(model.confidence_head.proj.weight)
    if target is not None and model.norm.weight.shape == target.model.norm.weight.shape:
        with torch.no_grad():
            model.norm.weight.copy_(target.model.norm.weight)
    return model


def saved_taps(folder: str) -> list[int] | None:
    """The target layers a saved drafter folder reads (DSpark or DFlash config layout)."""
    saved = json.loads((Path(folder) / "config.json").read_text())
    taps = saved.get("target_layer_ids") or (saved.get("dflash_config") or {}).get("target_layer_ids")
    return [int(t) for t in taps] if taps else None


def _drafts_from_masks(folder: str) -> bool:
    """A saved DSpark drafter on DFlash's block (`draft_from_anchor: false`)."""
    # deferred: the drafter model code loads only when a saved drafter is read
    from leapfrog.models.dflash import DrafterConfig
    d = DrafterConfig.from_hf(json.loads((Path(folder) / "config.json").read_text()))
    return d.kind == "dspark" and not d.draft_from_anchor


def narrow_shape(cfg: dict, init_from: str | None) -> dict:
    """``cfg`` with the shape of a narrow drafter (narrower than its target, its own embedding and
    LM head: ``target_hidden_size`` in its config) when ``init_from`` is one; ``cfg`` otherwise.
    Such a drafter continues at its own width, its embedding and LM head frozen."""
    if not init_from:
        return cfg
    saved = json.loads((Path(init_from) / "config.json").read_text())
    if saved.get("target_hidden_size", saved["hidden_size"]) == saved["hidden_size"]:
        return cfg
    return {**cfg, **{k: saved[k] for k in NARROW_KEYS if k in saved}}


def _continue_from(drafter, folder: str, heads_from: str | None = None) -> None:
    """Copy a saved drafter's weights (a folder `load_drafter` reads) into `drafter`, which must
    have the same shape: a longer run continues a shipped one instead of starting over. With
    `heads_from`, the DSpark heads (Markov, confidence) come from that drafter instead: a DSpark
    drafter on DFlash's block starts from a DFlash drafter's backbone and a DSpark drafter's heads."""
    # deferred: the drafter loader loads only when a run continues a drafter
    from leapfrog.methods.drafters import load_drafter

    saved = load_drafter(folder).state_dict()
    if heads_from:
        heads = {k: v for k, v in load_drafter(heads_from).state_dict().items()
                 if k.startswith(("markov_head.", "confidence_head."))}
        if not heads:
            raise ValueError(f"{heads_from}: not a DSpark drafter (no Markov or confidence head)")
        saved.update(heads)
        folder = f"{folder} with the heads of {heads_from}"
    mine = drafter.state_dict()
    wrong = sorted(k for k in mine if k not in saved or saved[k].shape != mine[k].shape)
    if wrong or set(saved) - set(mine):
        raise ValueError(f"{folder}: not a drafter of this recipe's shape "
                         f"(differs at {', '.join((wrong or sorted(set(saved) - set(mine)))[:3])})")
    drafter.load_state_dict(saved)


def break_symmetry(drafter, scale: float, seed: int) -> None:
    """Add N(0, (scale * std)^2) noise to each trainable matrix, std its own. A drafter grown
    wider by Net2Net copies (leapfrog.checkpoint.build) holds each unit `width` times; exact copies get
    identical gradients, so without this the grown width never becomes capacity (Net2Net §3)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad and p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * (scale * float(p.float().std())))


class Distiller:
    """Target + drafter + the per-sequence loss and the offline τ measurement."""

    def __init__(self, r: DrafterRecipe, target, drafter) -> None:
        # deferred: drafter_objectives (the model code) loads only when training
        from leapfrog.train.drafter_objectives import position_weights

        self.r, self.target, self.drafter = r, target, drafter
        self.gamma = drafter.drafter.num_draft_tokens
        self.taps = sorted(set(r.taps))
        self.tap_order = [self.taps.index(t) for t in r.taps]
        # A narrow drafter embeds and reads out with its own (frozen) tables, else the target's.
        own = drafter.embed_tokens
        self.embed = own.weight if own is not None else target.model.embed_tokens.weight
        if self.embed.stride(0) == 0:          # the target reads its table from quantized blocks
            self.embed = target.embed(torch.arange(self.embed.shape[0]))
        self.weights = position_weights(self.gamma, r.decay)

    @torch.no_grad()
    def target_pass(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tap features [T, m·d] and the target's logits [T, V] for one sequence."""
        pos = torch.arange(ids.numel())
        hidden, captured = self.target.forward(ids[None], pos[None], None, tuple(self.taps))
        feats = torch.cat([captured[j][0] for j in self.tap_order], dim=-1)
        return feats, self.target.compute_logits(hidden[0])

    def loss(self, seq: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
        # deferred: drafter_objectives (the model code) loads only when training
        from leapfrog.train.drafter_objectives import (
            block_labels,
            dflash_loss,
            dspark_loss,
            forward_blocks,
            sample_anchors,
            teacher_forced_heads,
        )

        ids = torch.tensor(seq["ids"], dtype=torch.long)
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[max(seq["start"] - 1, 0):] = True      # the last prompt token may anchor a block
        anchors = sample_anchors(mask, self.r.anchors, generator)
        feats, tlogits = self.target_pass(ids)
        labels, valid = block_labels(ids, mask, anchors, self.gamma)
        hidden = forward_blocks(self.drafter, feats, self.embed, ids, anchors)
        base = self.drafter.compute_logits(hidden, self.target)
        if self.drafter.markov_head is None and self.drafter.confidence_head is None:
            return {"loss": dflash_loss(base, labels, valid, self.weights)}
        prev = torch.cat([ids[anchors].unsqueeze(1), labels[:, :-1]], dim=1)
        logits, conf = teacher_forced_heads(base, hidden, prev, self.drafter.markov_head,
                                            self.drafter.confidence_head)
        rows = (anchors.unsqueeze(1) + torch.arange(self.gamma)).clamp(max=ids.numel() - 1)
        return dspark_loss(logits, tlogits[rows], conf, labels, valid, self.weights)

    @torch.no_grad()
    def drafted_paths(self, seqs: list[dict], stride: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
        """For anchors every `stride` tokens of the generated part of greedy sequences: the number
        of leading drafts equal to the target's greedy tokens [N], and the confidence logits
        along the drafted path [N, γ] (empty when the drafter has no confidence head)."""
        # deferred: drafter_objectives (the model code) loads only when training
        from leapfrog.train.drafter_objectives import forward_blocks

        accepted, conf_rows = [], []
        markov, conf = self.drafter.markov_head, self.drafter.confidence_head
        for seq in seqs:
            ids = torch.tensor(seq["ids"], dtype=torch.long)
            last = ids.numel() - self.gamma - 1
            anchors = torch.arange(max(seq["start"] - 1, 0), last, stride)
            if anchors.numel() == 0:
                continue
            feats, _ = self.target_pass(ids)
            hidden = forward_blocks(self.drafter, feats, self.embed, ids, anchors)
            base = self.drafter.compute_logits(hidden, self.target)
            prev, state, drafts, confs = ids[anchors], None, [], []
            for k in range(self.gamma):
                h, row, e = hidden[:, k], base[:, k], None
                if markov is not None:
                    bias, e, state = markov.step(prev, h, state)
                    row = row + bias.float()
                if conf is not None:
                    z = h if conf.proj.in_features == h.shape[-1] else torch.cat([h, e], dim=-1)
                    confs.append(conf.proj.forward(z).squeeze(-1).float())
                prev = row.argmax(-1)
                drafts.append(prev)
            drafts = torch.stack(drafts, 1)
            truth = ids[anchors.unsqueeze(1) + torch.arange(1, self.gamma + 1)]
            accepted.append((drafts == truth).to(torch.int64).cumprod(1).sum(1))
            if confs:
                conf_rows.append(torch.stack(confs, 1))
        acc = torch.cat(accepted) if accepted else torch.zeros(0, dtype=torch.int64)
        return acc, (torch.cat(conf_rows) if conf_rows else torch.zeros(0, self.gamma))

    def offline_tau(self, seqs: list[dict]) -> float:
        """τ as greedy speculative decoding sees it: draft at every position, then walk each
        sequence as the engine would (next anchor = this anchor + accepted + 1). Averaging over
        every anchor instead would overweight easy stretches, which the engine crosses in one
        step, and overstate the engine's τ."""
        steps, emitted = 0, 0
        for seq in seqs:
            acc, _ = self.drafted_paths([seq], stride=1)
            pos = 0
            while pos < acc.numel():
                n = int(acc[pos])
                steps += 1
                emitted += n + 1
                pos += n + 1
        return emitted / steps if steps else float("nan")


def acceptance_by_position(accepted: torch.Tensor, gamma: int) -> list[float]:
    """From the leading accepted drafts of each block (``Distiller.drafted_paths``): the share of
    blocks whose draft k held given drafts 1..k-1 did, k = 1..γ (NaN where none got that far)."""
    reached = [int((accepted >= k).sum()) for k in range(gamma + 1)]
    return [reached[k + 1] / reached[k] if reached[k] else float("nan") for k in range(gamma)]


def calibrate(distiller: Distiller, seqs: list[dict]) -> dict:
    """Fit STS temperatures on held-out drafted paths; ECE of the survival product before/after."""
    # deferred: drafter_objectives (the model code) loads only when training
    from leapfrog.train.drafter_objectives import (
        expected_calibration_error,
        fit_sequential_temperatures,
    )

    acc, logits = distiller.drafted_paths(seqs, stride=2)
    gamma = logits.shape[1]
    survived = acc.unsqueeze(1) > torch.arange(gamma)          # draft k accepted (all before it too)
    temps = fit_sequential_temperatures(logits, survived)

    def ece(ts: list[float]) -> list[float]:
        prefix, out = torch.ones(logits.shape[0]), []
        for k in range(gamma):
            prefix = prefix * torch.sigmoid(logits[:, k] / ts[k])
            out.append(round(expected_calibration_error(prefix, survived[:, k]), 4))
        return out
    return {"temperatures": temps, "ece_before": ece([1.0] * gamma), "ece_after": ece(temps),
            "num_blocks": int(logits.shape[0])}


# --- the loop ---------------------------------------------------------------------------------
def lr_at(step: int, r: DrafterRecipe) -> float:
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    progress = min(1.0, (step - r.warmup) / max(1, r.steps - r.warmup))
    return r.min_lr + 0.5 * (r.lr - r.min_lr) * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def _val_loss(d: Distiller, val: list[dict]) -> float:
    """Mean distillation loss on the held-out sequences, each with its own fixed anchor draw."""
    return sum(float(d.loss(s, torch.Generator().manual_seed(j))["loss"]) for j, s in enumerate(val)) / len(val)


def train_drafter(r: DrafterRecipe, resume: bool = False) -> dict:
    """Distil the drafter `r` describes, write its folder (drafter_export.export) and return the
    summary saved as its training.json."""
    # deferred: config and the model loader load only when a drafter is trained
    from leapfrog.config import resolve_model
    from leapfrog.models.loader import load_model, read_config

    torch.set_num_threads(r.threads)
    target_dir = resolve_model(r.target)
    target = load_model(target_dir, quantized=False).requires_grad_(False)
    tcfg = read_config(target_dir)
    mask_id = mask_token_id(target_dir)
    taps = saved_taps(r.init_from) if r.init_from else None
    if taps and taps != r.taps:          # continue on the taps the saved drafter reads; the
        r.taps = taps                    # recorded command names them (it must rebuild this recipe)
        r.command += " --taps " + ",".join(map(str, taps))
    if r.init_from and r.kind == "dspark" and r.block != "masks" and _drafts_from_masks(r.init_from):
        r.block = "masks"                # continuing a DSpark drafter on DFlash's block keeps it there
        r.command += " --block masks"
    train, val = load_data(r, target_dir)
    drafter = init_drafter(narrow_shape(drafter_config(r, tcfg, mask_id), r.init_from), r.seed, target)
    if r.init_from:
        _continue_from(drafter, r.init_from, r.heads_from)
    for table in (drafter.embed_tokens, drafter.lm_head):    # a narrow drafter's: kept as given
        if table is not None:
            table.weight.requires_grad_(False)
    if r.init_noise:              # (a resumed run loads its own weights over these below)
        break_symmetry(drafter, r.init_noise, r.seed)
    d = Distiller(r, target, drafter)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=r.lr, betas=(0.9, 0.95), weight_decay=0.0)
    run = Path(r.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    history = {"train": [], "val": [], "tau": [], "wall_s": 0.0, "blocks": 0}
    step = 0
    if resume and (run / "state.pt").is_file():
        state = torch.load(run / "state.pt", weights_only=False)
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, history = state["step"], state["history"]
        print(f"resumed {run / 'state.pt'} at step {step}", file=sys.stderr)
    # deferred: checkpoint.build and train.loop load only when a drafter is trained
    from leapfrog.checkpoint.build import weights_digest
    from leapfrog.train.loop import same_parent
    same_parent(history, "target", weights_digest(target_dir), str(target_dir), run / "state.pt")
    n_params = sum(p.numel() for p in params)
    print(f"{r.name}: {r.kind} drafter, {r.num_layers} layers, {n_params / 1e6:.2f}M parameters, "
          f"γ={d.gamma}, taps {r.taps}, {len(train)} training sequences", file=sys.stderr)
    step, history = _run_steps(r, d, opt, params, train, val, step, history, run)
    drafter.eval()
    history["tau"].append((step, d.offline_tau(val)))     # also refreshes a resumed, finished run
    if not history["val"]:                                 # no steps (an init_from folder as is)
        history["val"].append((step, _val_loss(d, val)))
    calib = calibrate(d, val) if drafter.confidence_head is not None else None
    by_position = acceptance_by_position(d.drafted_paths(val, stride=1)[0], d.gamma)
    summary = {"recipe": asdict(r), "num_params": n_params, "steps": step,
               "narrow": drafter.embed_tokens is not None,
               "wall_s": round(history["wall_s"], 1), "blocks_seen": history["blocks"],
               "val_loss": round(history["val"][-1][1], 4), "offline_tau": round(history["tau"][-1][1], 3),
               "acceptance_by_position": [round(a, 3) for a in by_position],
               "num_train_sequences": len(train), "num_val_sequences": len(val), "calibration": calib}
    export(r, d.drafter, tcfg, mask_id, history, summary)
    return summary


def _run_steps(r: DrafterRecipe, d: Distiller, opt, params, train: list[dict], val: list[dict],
               step: int, history: dict, run: Path) -> tuple[int, dict]:
    """Optimizer steps from `step` to r.steps: validation loss and offline τ every
    eval_interval steps, resumable state every ckpt_interval steps."""
    drafter = d.drafter
    bar = tqdm(total=r.steps, initial=step, file=sys.stderr, desc=r.name, dynamic_ncols=True)
    t0 = time.perf_counter() - history["wall_s"]
    drafter.train()
    while step < r.steps:
        g = torch.Generator().manual_seed(r.seed * 100003 + step)
        picks = torch.randint(len(train), (r.seqs_per_step,), generator=g).tolist()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, r)
        opt.zero_grad(set_to_none=True)
        parts = {}
        for i in picks:
            with autocast(r.dtype):
                out = d.loss(train[i], g)
            (out["loss"] / len(picks)).backward()
            for k, v in out.items():
                parts[k] = parts.get(k, 0.0) + v.item() / len(picks)
        total = parts["loss"]
        torch.nn.utils.clip_grad_norm_(params, r.grad_clip)
        opt.step()
        step += 1
        history["blocks"] += r.seqs_per_step * r.anchors
        history["train"].append((step, total))
        elapsed = time.perf_counter() - t0
        bar.update(1)
        bar.set_postfix(loss=f"{total:.3f}", **{k: f"{v:.3f}" for k, v in parts.items() if k != "loss"},
                        blocks_s=f"{history['blocks'] / max(elapsed, 1e-9):.0f}")
        if step % r.eval_interval == 0 or step == r.steps:
            drafter.eval()
            vloss = _val_loss(d, val)
            tau = d.offline_tau(val)
            drafter.train()
            history["val"].append((step, vloss))
            history["tau"].append((step, tau))
            bar.write(f"step {step}: val loss {vloss:.4f}, offline τ {tau:.3f} (γ={d.gamma})")
        if step % r.ckpt_interval == 0 or step == r.steps:
            history["wall_s"] = time.perf_counter() - t0
            torch.save({"model": drafter.state_dict(), "opt": opt.state_dict(), "step": step,
                        "history": history, "recipe": asdict(r)}, run / "state.tmp")
            (run / "state.tmp").replace(run / "state.pt")
    bar.close()
    history["wall_s"] = time.perf_counter() - t0
    return step, history


# --- command line -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="leapfrog train drafter",
        description="Distil a DFlash or DSpark drafter from a built-in target model. Variants: "
                    + ", ".join(f"{k} ({v['kind']}, {v['num_layers']} layers"
                                + (f", {v['head']} head" if 'head' in v else "") + ")"
                                for k, v in VARIANTS.items()))
    p.add_argument("variant", choices=sorted(VARIANTS))
    p.add_argument("--target", default="stories", help="built-in target model (default: stories)")
    p.add_argument("--data-dir", default=None, help="data folder (default ../shared/data or $LEAPFROG_DATA_DIR)")
    p.add_argument("--out", default=None, help="output folder (default checkpoints/<target>/drafters/<variant>)")
    p.add_argument("--run-dir", default=None, help="resumable state (default runs/drafter-<target>-<variant>)")
    for name, typ in (("steps", int), ("seqs-per-step", int), ("anchors", int), ("lr", float),
                      ("num-draft", int), ("markov-rank", int), ("num-regen", int), ("eval-interval", int),
                      ("threads", int), ("seed", int)):
        p.add_argument(f"--{name}", type=typ, default=None)
    p.add_argument("--taps", default=None, help="comma-separated target layer ids (default 0,2,4)")
    p.add_argument("--prompts", choices=("stories", "chat"), default=None,
                   help="training prompts: story openings (default) or chat requests answered through the "
                        "target's chat template (an instruction model such as smollm2)")
    p.add_argument("--layers", type=int, default=None, help="drafter layers (default: the variant's)")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="the drafter's MLP width (default: the target's): a smaller drafter to ship")
    p.add_argument("--regen-tokens", type=int, default=None, help="tokens the target writes per training prompt")
    p.add_argument("--ckpt-interval", type=int, default=None, help="steps between resumable states")
    p.add_argument("--dtype", choices=TRAIN_DTYPES, default=None,
                   help="autocast precision of the training steps (bf16: bfloat16 products, float32 "
                        "master weights; pays on a CPU with AVX512-BF16 or AMX)")
    p.add_argument("--block", choices=("anchor", "masks"), default=None,
                   help="DSpark's block: anchor (DeepSpec's, the default: γ slots, draft 1 from the anchor's) "
                        "or masks (DFlash's: the anchor and γ masks, draft 1 from the first mask's)")
    p.add_argument("--init-from", default=None, help="drafter folder of the same shape to continue from")
    p.add_argument("--heads-from", default=None,
                   help="DSpark drafter folder whose Markov and confidence heads start this drafter "
                        "(the rest from --init-from, which may be a DFlash drafter)")
    p.add_argument("--init-noise", type=float, default=None,
                   help="relative noise added to the --init-from weights' matrices (e.g. 1e-3 for a "
                        "drafter grown wider by copies, whose copies otherwise never diverge)")
    p.add_argument("--resume", action="store_true", help="continue from <run-dir>/state.pt")
    return p


def recipe_for(argv: list[str]) -> tuple[DrafterRecipe, argparse.Namespace]:
    """(DrafterRecipe, parsed flags) of `leapfrog train drafter ARGV`: the variant with the
    flags applied."""
    args = build_parser().parse_args(argv)
    opts = dict(VARIANTS[args.variant], name=args.variant, target=args.target)
    for key in ("data_dir", "steps", "seqs_per_step", "anchors", "lr", "num_draft", "markov_rank",
                "num_regen", "eval_interval", "threads", "seed", "init_from", "heads_from", "block",
                "dtype", "init_noise", "prompts", "intermediate_size", "regen_tokens", "ckpt_interval"):
        if getattr(args, key) is not None:
            opts[key] = getattr(args, key)
    if args.layers is not None:
        opts["num_layers"] = args.layers
    if args.out:
        opts["out_dir"] = args.out
    if args.run_dir:
        opts["run_dir"] = args.run_dir
    try:
        if args.taps:
            opts["taps"] = [int(t) for t in args.taps.split(",")]
        r = DrafterRecipe(**opts, command="leapfrog train drafter " + shlex.join(a for a in argv if a != "--resume"))
    except ValueError as e:               # a bad combination of flags: a usage error, before any work
        build_parser().error(str(e))
    return r, args


def main(argv: list[str] | None = None) -> int:
    r, args = recipe_for(list(sys.argv[1:] if argv is None else argv))
    try:
        s = train_drafter(r, resume=args.resume)
    except FileNotFoundError as e:        # the data folder, the target or an --init-from folder is not there
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {r.out_dir}: offline τ {s['offline_tau']}, val loss {s['val_loss']}, {s['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
