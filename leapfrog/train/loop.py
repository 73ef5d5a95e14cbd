"""One training loop for every built-in model: an objective (next-token cross-entropy, or the
block-diffusion losses of ``diffusion.py``) on packed token windows.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from leapfrog.train import large
from leapfrog.train.clover import grow_experts
from leapfrog.train.diffusion import DiffusionObjective, DiffusionSpec, contract
from leapfrog.train.distill import DistillSpec, distilled
from leapfrog.train.large import LoraSpec, export_delta, trainable_state
from leapfrog.train.precision import autocast
from leapfrog.train.tokenizer import TokenizerSpec


@dataclass(slots=True)
class ModelShape:
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 704
    max_position: int = 512
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    # Mixture of experts (num_experts > 0): a Qwen3-MoE whose every MLP is num_experts SwiGLU
    # experts of width moe_intermediate_size, num_experts_per_tok of them per token.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.01


@dataclass(slots=True)
class TrainConfig:
    name: str                                   # dataset: "stories" or "couplets"
    out_dir: str                                # final HF folder (checkpoints/<name>)
    run_dir: str                                # optimizer state, resumable (runs/<name>)
    data_dir: str | None = None
    model: ModelShape = field(default_factory=ModelShape)
    tokenizer: TokenizerSpec = field(default_factory=lambda: TokenizerSpec(vocab_size=4096))
    seq_len: int = 512
    batch_size: int = 4
    grad_accum: int = 1
    max_steps: int = 1000
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    # Start every window at a <s>: a window that opens mid-example shows a cut 上联 before a
    # whole 下联, which teaches that the sides need not match in length.
    align_to_bos: bool = False
    dtype: str = "fp32"                         # autocast: "fp32" or "bf16"
    save_dtype: str = "float16"                 # dtype of the exported safetensors
    eval_interval: int = 200
    eval_batches: int = 20
    ckpt_interval: int = 100
    seed: int = 1234
    threads: int = 1
    command: str = ""                           # the command line, for the README
    recipe: str = ""                            # recipe name where it differs from the dataset name
    init_from: str | None = None                # HF folder to start from (its shape and tokenizer)
    diffusion: DiffusionSpec | None = None      # block-diffusion objective instead of next-token
    # diffusion.mask_stream: the block-diffusion folder whose layers start the mask stream
    # (train.mask_stream; init_from is then the frozen AR parent)
    mask_stream_from: str | None = None
    long_repeats: int = 0                       # couplets: extra copies of pairs with long 上联
    rare_chars: int = 0                         # couplets: pairs with out-of-vocabulary 上联 characters
    distill: DistillSpec | None = None          # train on a parent model's own text (train.distill)
    # > 0: the exported weights are the mean of the weights after every step from this fraction
    # of max_steps on (stochastic weight averaging over the cosine tail), not the last step's.
    average_from: float = 0.0
    # Training-only sources (prepare's ``extra``) and the share of windows drawn from each; the
    # rest come from the dataset's own training stream.
    mix: tuple[tuple[str, float], ...] = ()
    # stories: train on the lowercased TinyStories file with its capitals restored (data.truecase);
    # the tokenizer stays the one trained on the files as they are.
    truecase: bool = False
    dropout: float = 0.0                        # residual and embedding dropout (fast forward)
    fast: bool = False                          # train.fast forward + fused AdamW where supported
    compile: bool = False                       # torch.compile the fast step (static shapes)
    ckpt_minutes: float = 0.0                   # > 0: also save state.pt this often (wall clock)
    keep_best: bool = False                     # export the weights of the best validation loss
    lora: LoraSpec | None = None                # train a grown recipe's model as a low-rank delta
    grow_experts: tuple[int, int, float] | None = None   # (experts, top_k, noise): init_from's MoE grown (clover)
    # > 0: add this weight times the token-level unlikelihood of the window's earlier tokens
    # (Welleck et al. 2019; fast forward only); validation still reports the cross-entropy.
    unlikelihood: float = 0.0
    # A token (e.g. "<sep>") after whose first occurrence in each example the rotary positions
    # restart (position coupling; fast forward only). The export declares it in leapfrog.json.
    coupled_positions: str | None = None


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine from lr down to min_lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def draw_windows(prep, cfg: TrainConfig, rng: np.random.Generator, start_ids: np.ndarray | None = None):
    """One micro-batch of training windows: each row from the dataset's stream, or from a mixed-in
    source with that source's share (``cfg.mix``), the choice drawn from the step's generator."""
    if not cfg.mix:
        return get_batch(prep.train, cfg.batch_size, cfg.seq_len, rng, start_ids)
    shares = np.array([w for _, w in cfg.mix], dtype=np.float64)
    picks = rng.choice(len(shares) + 1, size=cfg.batch_size, p=[1.0 - shares.sum(), *shares])
    rows_x, rows_y = [], []
    for row in picks:
        stream = prep.train if row == 0 else prep.extra[cfg.mix[row - 1][0]]
        x, y = get_batch(stream, 1, cfg.seq_len, rng, start_ids if row == 0 else None)
        rows_x.append(x)
        rows_y.append(y)
    return torch.cat(rows_x), torch.cat(rows_y)


def get_batch(stream: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator,
              start_ids: np.ndarray | None = None):
    """Random windows of seq_len + 1 tokens: inputs and next-token targets. With start_ids the
    windows begin at those positions only."""
    if start_ids is not None:
        starts = start_ids[rng.integers(0, len(start_ids), size=batch_size)]
    else:
        starts = rng.integers(0, len(stream) - seq_len - 1, size=batch_size)
    rows = np.stack([stream[s:s + seq_len + 1].astype(np.int64) for s in starts])
    t = torch.from_numpy(rows)
    return t[:, :-1], t[:, 1:]


def build_model(shape: ModelShape, vocab_size: int, bos_id: int = 1, eos_id: int = 2):
    # deferred: transformers is heavy and loads only when a model is built
    import transformers

    common = dict(
        vocab_size=vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position, rope_theta=shape.rope_theta,
        tie_word_embeddings=shape.tie_embeddings, bos_token_id=bos_id, eos_token_id=eos_id,
        pad_token_id=eos_id, rms_norm_eps=1e-5, attention_bias=False,
    )
    if shape.num_experts:
        config = transformers.Qwen3MoeConfig(
            **common, head_dim=shape.hidden_size // shape.num_heads, num_experts=shape.num_experts,
            num_experts_per_tok=shape.num_experts_per_tok, moe_intermediate_size=shape.moe_intermediate_size,
            norm_topk_prob=True, router_aux_loss_coef=shape.router_aux_loss_coef)
        return transformers.Qwen3MoeForCausalLM(config)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, mlp_bias=False))


def load_pretrained(folder: str):
    """An HF Llama or Qwen3-MoE folder as an fp32 transformers model, and its shape as a ModelShape."""
    # deferred: transformers is heavy and loads only when a folder is loaded
    from transformers import LlamaForCausalLM, Qwen3MoeForCausalLM

    moe = json.loads((Path(folder) / "config.json").read_text()).get("model_type") == "qwen3_moe"
    cls = Qwen3MoeForCausalLM if moe else LlamaForCausalLM
    model = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    return model, shape_of(model.config)


def shape_of(c) -> ModelShape:
    """A transformers config's shape."""
    return ModelShape(hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
                      num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                      intermediate_size=c.intermediate_size, max_position=c.max_position_embeddings,
                      rope_theta=(c.rope_parameters or {}).get("rope_theta", 10000.0),
                      tie_embeddings=c.tie_word_embeddings, num_experts=getattr(c, "num_experts", 0) or 0,
                      num_experts_per_tok=getattr(c, "num_experts_per_tok", 2),
                      moe_intermediate_size=getattr(c, "moe_intermediate_size", 0) or 0,
                      router_aux_loss_coef=getattr(c, "router_aux_loss_coef", 0.01))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # Decay matrices only: decaying norms' gains pulls them towards zero for no benefit.
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=cfg.fast)


def loss_on(model, x: torch.Tensor, y: torch.Tensor, dtype: str) -> torch.Tensor:
    """Next-token cross-entropy. While an MoE trains, plus its router's load-balancing loss
    (Switch Transformer eq. 4, weighted by router_aux_loss_coef), so experts share the tokens;
    validation (eval mode) reports the cross-entropy alone."""
    balance = model.training and getattr(model.config, "num_experts", 0) > 0
    with autocast(dtype):
        out = model(input_ids=x, output_router_logits=True) if balance else model(input_ids=x)
    loss = F.cross_entropy(out.logits.float().reshape(-1, out.logits.size(-1)), y.reshape(-1))
    return loss + model.config.router_aux_loss_coef * out.aux_loss if balance else loss


class NextToken:
    """The AR objective: next-token cross-entropy. An objective turns the loop's windows into a
    batch (drawing any noise from the step's generator) and a batch into (loss, parts)."""

    def batch(self, x: torch.Tensor, y: torch.Tensor, rng: np.random.Generator, train: bool = True):
        return x, y

    def loss(self, model, batch, dtype: str) -> tuple[torch.Tensor, dict[str, float]]:
        return loss_on(model, *batch, dtype), {}


class FastNextToken(NextToken):
    """NextToken through ``train.fast`` (optionally compiled): the same loss, less overhead."""

    def __init__(self, model, cfg: TrainConfig, tok=None) -> None:
        # deferred: train.fast loads only for the fast objective
        from leapfrog.train import fast
        self.cos, self.sin = fast.rope_table(model, cfg.model.max_position)
        self.dropout, self.ul = cfg.dropout, cfg.unlikelihood
        self.anchor = None
        if cfg.coupled_positions:
            self.anchor = (tok.bos_token_id, tok.convert_tokens_to_ids(cfg.coupled_positions))

        def build(fn):
            return torch.compile(fn, fullgraph=True, dynamic=False) if cfg.compile else fn
        self.fn = build(fast.causal_lm_loss)
        self.fn_ul = build(fast.causal_lm_loss_ul) if self.ul > 0 else None

    def loss(self, model, batch, dtype: str) -> tuple[torch.Tensor, dict[str, float]]:
        # deferred: layers.rotary loads only when a loss is computed
        from leapfrog.layers.rotary import coupled_positions
        positions = coupled_positions(batch[0], *self.anchor) if self.anchor is not None else None
        with autocast(dtype):
            if self.fn_ul is not None and model.training:
                total, ce, ul = self.fn_ul(model, *batch, self.cos, self.sin, self.dropout, self.ul, positions)
                return total, {"ce": ce.item(), "unlikelihood": ul.item()}
            return self.fn(model, *batch, self.cos, self.sin, self.dropout, positions), {}


def make_objective(cfg: TrainConfig, tok, model=None):
    if cfg.diffusion is None:
        # deferred: train.fast loads only for the fast objective
        from leapfrog.train import fast
        if cfg.fast and model is not None and fast.supported(model):
            return FastNextToken(model, cfg, tok)
        if cfg.dropout or cfg.compile or cfg.unlikelihood or cfg.coupled_positions:
            raise ValueError("dropout, compile, unlikelihood and coupled positions need the fast forward "
                             "(fast=True, a dense Llama)")
        return NextToken()
    return DiffusionObjective(cfg.diffusion, tok.convert_tokens_to_ids("<mask>"))


@torch.no_grad()
def evaluate(model, stream: np.ndarray, cfg: TrainConfig, objective=None) -> tuple[float, dict]:
    """Mean loss (and mean parts) on fixed validation windows and noise (the same every time, so
    curves compare)."""
    objective = objective or NextToken()
    model.eval()
    rng = np.random.default_rng(0)
    seq_len = min(cfg.seq_len, len(stream) - 2)
    if cfg.diffusion is not None:
        seq_len -= seq_len % cfg.diffusion.block_size
    losses, parts = [], {}
    for _ in range(cfg.eval_batches):
        batch = objective.batch(*get_batch(stream, cfg.batch_size, seq_len, rng), rng, train=False)
        loss, p = objective.loss(model, batch, cfg.dtype)
        losses.append(loss.item())
        for k, v in p.items():
            parts.setdefault(k, []).append(v)
    model.train()
    return float(np.mean(losses)), {k: round(float(np.mean(v)), 4) for k, v in parts.items()}


class WeightAverage:
    """Running mean of a model's parameters over the steps it is given (SWA with a constant
    weight per step). ``copy_to`` puts the mean into the model."""

    def __init__(self) -> None:
        self.mean: dict[str, torch.Tensor] = {}
        self.count = 0

    @torch.no_grad()
    def add(self, model) -> None:
        self.count += 1
        for name, p in model.named_parameters():
            if name not in self.mean:
                self.mean[name] = p.detach().float().clone()
            else:
                self.mean[name].lerp_(p.detach().float(), 1.0 / self.count)

    @torch.no_grad()
    def copy_to(self, model) -> None:
        for name, p in model.named_parameters():
            p.copy_(self.mean[name].to(p.dtype))


def weights_to_save(model) -> dict[str, torch.Tensor]:
    """What a run's state keeps of the model: every weight, or with frozen weights (a low-rank
    run: 600 MB frozen against a few MB trained) only the trained ones."""
    if all(p.requires_grad for p in model.parameters()):
        return model.state_dict()
    return trainable_state(model)


def save_state(run_dir: Path, model, opt, step: int, history: dict,
               average: WeightAverage | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    state = {"model": weights_to_save(model), "optimizer": opt.state_dict(), "step": step, "history": history}
    if average is not None and average.count:
        state["average"] = {"mean": average.mean, "count": average.count}
    _save_atomic(state, run_dir / "state.pt")  # a kill mid-save keeps the previous state


def _load_weights(model, weights: dict) -> None:
    """Load saved weights: all of them, or a frozen model's trained ones (weights_to_save)."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    if unexpected or (set(missing) & trained) or (len(weights) < len(trained)):
        raise ValueError(f"saved weights do not fit the model (missing {sorted(set(missing) & trained)[:3]}, "
                         f"unexpected {unexpected[:3]})")


def load_state(run_dir: Path, model, opt, average: WeightAverage | None = None) -> tuple[int, dict]:
    state = torch.load(run_dir / "state.pt", map_location="cpu", weights_only=False)
    _load_weights(model, state["model"])
    opt.load_state_dict(state["optimizer"])
    if average is not None and "average" in state:
        average.mean, average.count = state["average"]["mean"], state["average"]["count"]
    return state["step"], state["history"]


def same_parent(history: dict, key: str, digest: str | None, folder: str, state_path: Path) -> None:
    """Refuse to resume a run whose saved state was trained from (or against) other weights than
    ``folder`` holds now: a retrained parent would otherwise be mixed silently into the old run.
    Records the digest in ``history`` (saved with the state) for a run that lacks it."""
    if digest is None:
        return
    saved = history.get(key)
    if saved is not None and saved != digest:
        raise ValueError(f"{state_path}: this run was trained with the weights in {folder} as they were "
                         f"(digest {saved}); they are now {digest} (retrained?). Remove {state_path.parent} "
                         "to start over, or train without --resume")
    if saved is None and history.get("train"):
        print(f"{state_path}: saved before runs recorded their parent's weights; resuming it as is",
              file=sys.stderr)
    history[key] = digest


def _parent(cfg: TrainConfig) -> str | None:
    """The folder whose weights this run starts from: init_from, or a low-rank run's base."""
    if cfg.lora is not None:
        return str(large.base_folder(cfg.lora))
    return cfg.init_from


def train(cfg: TrainConfig, resume: bool = False, prepared=None) -> dict:
    """Train per cfg and write the checkpoint folder; returns the summary written to its README."""
    # deferred: train.export loads only when a run trains
    from leapfrog.train import export

    torch.set_num_threads(cfg.threads)  # leave the other cores to whoever shares the machine
    torch.manual_seed(cfg.seed)
    if cfg.init_from and not (Path(cfg.init_from) / "config.json").is_file():
        raise FileNotFoundError(f"{cfg.init_from}: no checkpoint to start {cfg.recipe or cfg.name} "
                                "from (train that model first)")
    prep = prepared or training_data(cfg)
    model, tok = _model_and_tokenizer(cfg, prep)
    opt = make_optimizer(model, cfg)
    run_dir = Path(cfg.run_dir)
    step, history = 0, {"train": [], "val": [], "val_parts": [], "wall_s": 0.0, "tokens": 0}
    average = WeightAverage() if cfg.average_from > 0 else None
    if resume and (run_dir / "state.pt").exists():
        step, history = load_state(run_dir, model, opt, average)
        print(f"resumed from {run_dir / 'state.pt'} at step {step}", flush=True)
    parent = _parent(cfg)
    if parent is not None:
        # deferred: checkpoint.build loads only for runs with a parent
        from leapfrog.checkpoint.build import weights_digest
        same_parent(history, "parent", weights_digest(parent), parent, run_dir / "state.pt")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
    step, history = _run_steps(model, opt, prep, cfg, step, history, run_dir,
                               make_objective(cfg, tok, model), average)
    if cfg.keep_best and (run_dir / "best.pt").exists():
        best = torch.load(run_dir / "best.pt", map_location="cpu", weights_only=True)
        _load_weights(model, best["model"])
        history["exported"] = {"step": best["step"], "val": best["val"]}
    if cfg.lora is not None:             # the delta into the recipe folder, not a model folder
        return export_delta(model, cfg, history, prep)
    summary = export.save_checkpoint(model, tok, prep, cfg, history)
    export.write_sha256sums(cfg.out_dir)
    return summary


def training_data(cfg: TrainConfig):
    """The tokenizer and token streams of cfg's dataset (train.prepare), with the training
    stream replaced by a parent's text (``distill``) or extended by rare-character pairs
    (``rare_chars``) where the recipe asks."""
    # deferred: train.prepare loads only when data is prepared
    from leapfrog.train.prepare import prepare

    prep = prepare(cfg.name, cfg.tokenizer, cfg.data_dir, cfg.seed, cfg.model.max_position,
                   cfg.long_repeats, tuple(source for source, _ in cfg.mix), cfg.truecase)
    if cfg.distill is not None:
        prep = distilled(prep, cfg.name, cfg.distill, cfg.seed, cfg.data_dir)
    if cfg.rare_chars:
        # deferred: train.couplets loads only for rare-character pairs
        from leapfrog.train.couplets import with_rare_chars
        prep = with_rare_chars(prep, cfg.name, cfg.rare_chars, cfg.seed, cfg.data_dir)
    return prep


def _model_and_tokenizer(cfg: TrainConfig, prep):
    """A fresh model for the data's tokenizer, or the init_from folder's weights and tokenizer."""
    # deferred: transformers is heavy and loads only when a model is made
    from transformers import AutoTokenizer
    if cfg.lora is not None:
        model, base = large.grown_model(cfg.lora)
        tok = AutoTokenizer.from_pretrained(base)
        _check_same_vocab(tok, AutoTokenizer.from_pretrained(prep.tokenizer_dir), str(base))
        c = model.config
        cfg.model = ModelShape(hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
                               num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                               intermediate_size=c.intermediate_size, max_position=c.max_position_embeddings,
                               tie_embeddings=c.tie_word_embeddings)
        large.add_low_rank(model, cfg.lora, cfg.seed)
        return model, tok
    if cfg.init_from:
        tok = AutoTokenizer.from_pretrained(cfg.init_from)
        _check_same_vocab(tok, AutoTokenizer.from_pretrained(prep.tokenizer_dir), cfg.init_from)
        model, cfg.model = load_pretrained(cfg.init_from)
        if cfg.grow_experts is not None:     # sparse upcycling: more experts, copies of init_from's
            experts, top_k, noise = cfg.grow_experts
            model = grow_experts(model, experts, top_k, noise, cfg.seed)
            cfg.model = shape_of(model.config)
    else:
        tok = AutoTokenizer.from_pretrained(prep.tokenizer_dir)
        model = build_model(cfg.model, len(tok), tok.bos_token_id, tok.eos_token_id)
    if cfg.diffusion is not None:        # the decoder's contract, saved with config.json
        model.config.update(contract(cfg.diffusion, tok.convert_tokens_to_ids("<mask>")))
        if cfg.diffusion.mask_stream:
            # deferred: mask_stream loads only for two-stream models
            from leapfrog.train.mask_stream import attach
            source = load_pretrained(cfg.mask_stream_from)[0] if cfg.mask_stream_from else None
            attach(model, source, tok.convert_tokens_to_ids("<mask>"))
    return model, tok


def _check_same_vocab(tok, data_tok, folder: str) -> None:
    """The token streams are encoded by the data's tokenizer: refuse a model with another one."""
    if tok.get_vocab() != data_tok.get_vocab():
        raise ValueError(f"{folder}: tokenizer differs from the one the data was encoded with "
                         "(train with the same dataset, tokenizer spec and seed as that model)")


def _run_steps(model, opt, prep, cfg: TrainConfig, step: int, history: dict, run_dir: Path,
               objective=None, average: WeightAverage | None = None):
    objective = objective or NextToken()
    average_start = math.ceil(cfg.average_from * cfg.max_steps) if average is not None else None
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    start_ids = None
    if cfg.align_to_bos:
        start_ids = np.flatnonzero(np.asarray(prep.train) == 1)  # 1 = <s> (tokenizer.py layout)
        start_ids = start_ids[start_ids < len(prep.train) - cfg.seq_len - 1]
    bar = tqdm(total=cfg.max_steps, initial=step, file=sys.stderr, mininterval=10,
               desc=cfg.name, dynamic_ncols=False)
    if cfg.keep_best and step == 0 and (cfg.init_from or cfg.lora):
        # the starting weights are a candidate: the export is never worse than where it began
        val, _ = evaluate(model, prep.val, cfg, objective)
        history["val"].append((0, val))
        history["best_val"] = val
        _save_atomic({"model": weights_to_save(model), "step": 0, "val": val}, run_dir / "best.pt")
        print(f"step 0 val {val:.4f}", flush=True)
    model.train()
    t_last = last_save = time.time()
    clock = StepClock()
    while step < cfg.max_steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        rng = np.random.default_rng([cfg.seed, step])
        if cfg.dropout:            # dropout masks of step s depend on (seed, s) only: exact resume
            torch.manual_seed(int(rng.integers(2**62)))
        total = 0.0
        for _ in range(cfg.grad_accum):
            batch = objective.batch(*draw_windows(prep, cfg, rng, start_ids), rng)
            loss, _ = objective.loss(model, batch, cfg.dtype)
            (loss / cfg.grad_accum).backward()
            total += loss.item() / cfg.grad_accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        now = time.time()
        history["wall_s"] += clock.training_seconds(now - t_last, history)
        history["tokens"] += tokens_per_step
        history["train"].append((step, total))
        bar.update(1)
        bar.set_postfix(loss=f"{total:.3f}", tok_s=f"{tokens_per_step / max(now - t_last, 1e-9):.0f}")
        t_last = now
        if average_start is not None and step >= average_start:
            average.add(model)
            if step == cfg.max_steps:     # the last step: evaluate and save the mean weights
                history["averaged_steps"] = average.count
                average.copy_to(model)
        if step % cfg.eval_interval == 0 or step == cfg.max_steps:
            val, parts = evaluate(model, prep.val, cfg, objective)
            history["val"].append((step, val))
            history.setdefault("val_parts", []).append((step, parts))
            rate = history["tokens"] / max(history["wall_s"], 1e-9)
            extra = "".join(f" val_{k} {v:.4f}" for k, v in parts.items() if not k.endswith("_targets"))
            print(f"step {step} train {total:.4f} val {val:.4f}{extra} lr {lr_at(step, cfg):.2e} "
                  f"tokens {history['tokens']} tok/s {rate:.0f} wall {history['wall_s']:.0f}s",
                  flush=True)
            if cfg.keep_best and val < history.get("best_val", float("inf")):
                history["best_val"] = val
                _save_atomic({"model": weights_to_save(model), "step": step, "val": val}, run_dir / "best.pt")
            t_last = time.time()  # evaluation time is not training time
        if (step % cfg.ckpt_interval == 0 or step == cfg.max_steps
                or (cfg.ckpt_minutes and time.time() - last_save >= cfg.ckpt_minutes * 60)):
            save_state(run_dir, model, opt, step, history, average)
            write_progress(run_dir, cfg, step, history)
            last_save = t_last = time.time()
    bar.close()
    return step, history


class StepClock:
    """How much of a step's wall time was training: a step that took over a minute and 20x the
    usual (the process stopped with SIGSTOP, the machine suspended) counts as a usual step, the
    rest as ``history["paused_s"]``, so tok/s stays the rate of training. The first steps of a
    process (compilation) are never judged."""

    def __init__(self) -> None:
        self.steps, self.typical = 0, 0.0

    def training_seconds(self, dt: float, history: dict) -> float:
        self.steps += 1
        if self.steps > 3 and dt > max(60.0, 20 * self.typical):
            history["paused_s"] = history.get("paused_s", 0.0) + dt - self.typical
            return self.typical
        if self.steps >= 3:
            self.typical = dt if self.steps == 3 else 0.95 * self.typical + 0.05 * dt
        return dt


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def write_progress(run_dir: Path, cfg: TrainConfig, step: int, history: dict) -> None:
    """The run's progress beside its state: progress.json (step, tokens, rate, last losses) and
    loss.png, so a run that spans sessions shows where it is without loading anything."""
    # deferred: train.export loads only when progress is written
    from leapfrog.train.export import plot_loss
    recent = [loss for _, loss in history["train"][-50:]]
    progress = {
        "recipe": cfg.recipe or cfg.name, "step": step, "max_steps": cfg.max_steps,
        "tokens": history["tokens"], "target_tokens": cfg.max_steps * cfg.batch_size * cfg.seq_len * cfg.grad_accum,
        "wall_s": round(history["wall_s"], 1),
        "paused_s": round(history.get("paused_s", 0.0), 1),
        "tok_s": round(history["tokens"] / max(history["wall_s"], 1e-9)),
        "train_loss_recent": round(float(np.mean(recent)), 4) if recent else None,
        "val": history["val"][-1] if history["val"] else None,
        "best_val": history.get("best_val"),
        "updated": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    (run_dir / "progress.json").write_text(json.dumps(progress, indent=2) + "\n")
    plot_loss(history, run_dir / "loss.png", f"{progress['recipe']} (step {step}/{cfg.max_steps})")
