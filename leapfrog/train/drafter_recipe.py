"""A drafter training recipe: its shape, schedule and data, and the variants that ship."""
from __future__ import annotations

from dataclasses import dataclass, field

from leapfrog.data.corpus import REPO_ROOT
from leapfrog.train.precision import TRAIN_DTYPES


@dataclass(slots=True)
class DrafterRecipe:
    name: str = "dspark-markov-2l"
    target: str = "stories"
    kind: str = "dspark"                  # dspark | dflash
    num_layers: int = 2
    head: str = "vanilla"                 # DSpark sequential head: vanilla (Markov) | gated | rnn
    markov_rank: int = 64
    num_draft: int = 8                    # γ: drafts per block (DFlash block = γ + 1, DSpark block = γ)
    taps: list[int] = field(default_factory=lambda: [0, 2, 4])
    block: str = "anchor"                 # DSpark's block: anchor (DeepSpec: γ slots, draft 1 from the
                                          # anchor's) | masks (DFlash's: anchor + γ masks)
    steps: int = 1500
    seqs_per_step: int = 4
    anchors: int = 48                     # blocks per sequence
    lr: float = 1.5e-3
    min_lr: float = 5e-5
    warmup: int = 60
    decay: float = 4.0                    # position-weight decay constant (DeepSpec: 4)
    grad_clip: float = 1.0
    eval_interval: int = 250
    ckpt_interval: int = 100
    num_regen: int = 1600                 # regenerated training sequences
    num_val: int = 48                     # held-out greedy sequences (offline τ, calibration)
    regen_tokens: int = 160
    seed: int = 1234
    threads: int = 1
    dtype: str = "fp32"                   # training steps' autocast: fp32 | bf16 (float32 master weights;
                                          # validation, offline τ and calibration stay float32)
    data_dir: str | None = None
    intermediate_size: int | None = None  # the drafter's MLP width (None: the target's)
    prompts: str = "stories"              # stories: story openings continued | chat: chat requests
                                          # answered through the target's chat template (data/chat_prompts.py)
    init_from: str | None = None          # a drafter folder of this shape to continue from
    heads_from: str | None = None         # a DSpark drafter whose Markov and confidence heads start this
                                          # one, the rest from init_from (e.g. a DFlash drafter)
    init_noise: float = 0.0               # relative std of noise added to init_from's matrices: a drafter
                                          # grown wider by copies needs it, or the copies stay copies
    out_dir: str = ""
    run_dir: str = ""
    command: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("dflash", "dspark"):
            raise ValueError(f"kind={self.kind!r}: expected dflash or dspark")
        if self.dtype not in TRAIN_DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {', '.join(TRAIN_DTYPES)}")
        if self.prompts not in ("stories", "chat"):
            raise ValueError(f"prompts={self.prompts!r}: expected stories or chat")
        if self.block not in ("anchor", "masks"):
            raise ValueError(f"block={self.block!r}: expected anchor or masks")
        for name in ("num_layers", "markov_rank", "num_draft", "seqs_per_step", "anchors",
                     "eval_interval", "ckpt_interval", "num_regen", "num_val", "regen_tokens", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        if not isinstance(self.steps, int) or self.steps < 0:      # 0: export the starting weights
            raise ValueError(f"steps={self.steps!r}: must be an integer >= 0")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and self.lr < float("inf")):
            raise ValueError(f"lr={self.lr!r}: must be a positive number")
        if not self.taps or any(not isinstance(t, int) or t < 0 for t in self.taps):
            raise ValueError(f"taps={self.taps!r}: must be target layer ids (integers >= 0)")
        if not (isinstance(self.init_noise, (int, float)) and 0 <= self.init_noise < 1):
            raise ValueError(f"init_noise={self.init_noise!r}: must be a number in [0, 1)")
        if self.init_noise and not self.init_from:
            raise ValueError("init_noise (--init-noise) perturbs a starting drafter: it needs init_from (--init-from)")
        if self.heads_from and (self.kind != "dspark" or not self.init_from):
            raise ValueError("heads_from (--heads-from) is for a DSpark drafter and needs init_from "
                             "(--init-from, the drafter the rest starts from)")
        self.out_dir = self.out_dir or str(REPO_ROOT / "checkpoints" / self.target / "drafters" / self.name)
        self.run_dir = self.run_dir or str(REPO_ROOT / "runs" / f"drafter-{self.target}-{self.name}")


# The variants `leapfrog bench --methods` compares (issue 5): DFlash with 2 and 5 layers, DSpark
# with the Markov and the RNN head on 2 layers. Same taps, γ and data for all.
VARIANTS = {
    "dflash-2l": dict(kind="dflash", num_layers=2),
    "dflash-5l": dict(kind="dflash", num_layers=5),
    "dspark-markov-2l": dict(kind="dspark", num_layers=2, head="vanilla"),
    "dspark-rnn-2l": dict(kind="dspark", num_layers=2, head="rnn"),
}
