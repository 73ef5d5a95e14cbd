"""The README.md of a checkpoint folder: how it was made, how good it is, how to reproduce it.

    python -m leapfrog.train.readme checkpoints/stories   # re-measure and rewrite after a run
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from leapfrog.data.corpus import REPO_ROOT
from leapfrog.train.check import CheckResult, run_check
from leapfrog.train.export import write_sha256sums

DATA_NOTES = {
    "stories": (
        "TinyStories (Eldan & Li 2023, CDLA-Sharing-1.0) from `../shared/data/stories/`: "
        "`tinystories_cased.txt` + `tinystories_valid.txt` (4% of these held out by a hash of the "
        "story, see `leapfrog.data.corpus.heldout`) and `tinystories_lowercase.txt` (training only). "
        "`classics.txt` (public-domain children's books, Project Gutenberg) is used only when the "
        "recipe mixes it in (the table below), never for the tokenizer or validation. Each story is "
        "`<s> story </s>`; training windows are random 256-token slices of the concatenated stream."
    ),
    "couplets": (
        "`../shared/data/couplets/`: `couplets.tsv` (2% of 上联 held out by hash), "
        "`poetry_pairs.tsv` and `spring_festival.tsv` (training only; any record sharing a side "
        "with a held-out pair is dropped). Licences and provenance: that folder's SOURCE.md."
    ),
}

COUPLET_FORMATS = """## Prompt formats

- **The tokenizer ends every prompt with `<sep>`**, as it starts it with `<s>`: tokenizer.json's
  post-processor is `<s> $A <sep>` (tokenizer_config.json names `PreTrainedTokenizerFast`, which
  keeps it), so leapfrog, `transformers.AutoTokenizer` and any server built on them hand the
  model `<s>prompt<sep>` for a raw prompt. `<sep>` is a special token, dropped by
  `decode(..., skip_special_tokens=True)`. Training streams are encoded without the post-processor.
- **Pair mode** (no template): the prompt is the raw 上联, the completion is the 下联.
  Trained as `<s>上联<sep>下联</s>`. Greedy decoding is the default (generation_config.json).
  A prompt that already ends with the text `<sep>` (the format before the tokenizer added it)
  encodes as `上联<sep><sep>`; 3% of the pair examples are written that way (how well that case
  does is `length_match_explicit_sep` above).
- **Keyword mode**: prompt `关键词：春 福\\n` (1-3 keywords of 1-2 characters, separated by spaces,
  ending with a newline); completion `上联：…\\n下联：…\\n横批：…` then `</s>`, trained as
  `<s>关键词：春 福\\n<sep>上联：…</s>`.
  Keywords were sampled from the couplets themselves. Only `spring_festival.tsv` has a real 横批
  (repeated 20 times with fresh keywords); for a quarter of the other pairs the 横批 is the
  4-character phrase (real 横批 or 4-character couplet side) sharing the most characters with the
  couplet, so 横批 is learned as "a four-character phrase on the couplet's theme".
- **Chat** (`/v1/chat/completions`): `chat_template.jinja` renders a conversation as its last
  user message alone, so a chat turn is a pair-mode (or keyword-mode) prompt: the reply to
  `春风送暖入屠苏` is its 下联, as from `/v1/completions`. The vocabulary cannot spell the
  `user:` / `assistant:` lines a model without a template gets, and earlier turns are not
  context the model was trained on.
- Tokenizer: SentencePiece BPE with pieces of at most one character (one token per 汉字),
  {rare}, `add_prefix_space` false.
"""

RARE_BYTES = "byte fallback for the rare characters outside 99.95% coverage"
RARE_UNK = ("a rare character outside 99.95% coverage encoded as one `<unk>` (no byte fallback: "
            "the same vocabulary and ids, the byte pieces unused), so every 上联 is as many tokens "
            "as characters")

def render(summary: dict, check: CheckResult, folder: Path) -> str:
    cfg = summary["config"]
    m = cfg["model"]
    lines = [
        f"# {_model_name(folder)} — a built-in leapfrog model",
        "",
        f"A {summary['num_params'] / 1e6:.2f}M-parameter {_architecture(m)}: hidden "
        f"{m['hidden_size']}, {m['num_layers']} layers, {m['num_heads']} heads / "
        f"{m['num_kv_heads']} KV heads, {_mlp(m, folder)}, context "
        f"{m['max_position']}, tied embeddings, vocabulary {cfg['tokenizer']['vocab_size']} asked) "
        f"{_origin(summary)}. Weights are stored as "
        f"**{summary['save_dtype']}** safetensors (trained in fp32; load with `dtype=torch.float32` "
        f"for CPU inference). {_loaders(m)} `SHA256SUMS` lists every file "
        "(`sha256sum -c SHA256SUMS`).",
        "",
        "## Data",
        "",
        DATA_NOTES.get(cfg["name"], ""),
        "",
        "## Training",
        "",
        "| | |", "|---|---|",
        f"| parameters | {summary['num_params']:,} |",
        f"| steps | {summary['steps']:,} (batch {cfg['batch_size']} x {cfg['seq_len']} tokens"
        f" x accumulation {cfg['grad_accum']}) |",
        f"| tokens seen | {summary['tokens_seen']:,} (training stream: {summary['train_tokens']:,} tokens) |",
        f"| wall time | {summary['wall_s'] / 60:.1f} min on {cfg['threads']} CPU thread(s) |",
        f"| optimiser | AdamW (betas {tuple(cfg['betas'])}, weight decay {cfg['weight_decay']}), "
        f"lr {cfg['lr']} cosine to {cfg['min_lr']} after {cfg['warmup_steps']} warm-up steps, "
        f"clip {cfg['grad_clip']}, {cfg['dtype']} |",
        *_loss_rows(summary),
        f"| validation set | {summary['num_val_items']:,} held-out items, {summary['val_tokens']:,} tokens |",
        "",
        *[f"Note: {note}" for note in summary.get("notes", [])],
        "",
        "![loss](loss.png)",
        "",
        *(_diffusion_section(summary, folder) if cfg.get("diffusion") else []),
        *(_coupled_section(cfg["coupled_positions"]) if cfg.get("coupled_positions") else []),
        "## Measured (" + ("slow reference decoder" if cfg.get("diffusion") else "transformers `generate`")
        + ", `python -m leapfrog.train.check`)",
        "",
        "```json",
        json.dumps(check.metrics, ensure_ascii=False, indent=2),
        "```",
        "",
    ]
    if cfg["name"] == "couplets":
        fallback = cfg["tokenizer"].get("byte_fallback", True)
        lines += [COUPLET_FORMATS.replace("{rare}", RARE_BYTES if fallback else RARE_UNK)]
    # A folder made in several runs lists its commands in training.json's "reproduce".
    commands = summary.get("reproduce") or [cfg["command"] or f"leapfrog train {summary['recipe']}",
                                             f"# or: python -m leapfrog.train.cli {summary['recipe']}"]
    lines += ["## Samples", ""] + _samples(check) + [
        "## Reproduce", "",
        "From the repository root, with the data in `../shared/data`:", "",
        "```", *commands, "```", "",
        "The seed fixes initialisation and batch order; an interrupted run continues with `--resume`.",
        "",
    ]
    return "\n".join(lines)


def _origin(summary: dict) -> str:
    if summary.get("soup"):     # leapfrog.train.soup: a weighted mean of checkpoints' weights
        parts = " + ".join(f"{p['weight']:g} x `{p['folder']}`" + (f" ({p['recipe']})" if p.get("recipe") else "")
                           for p in summary["soup"])
        return f"whose weights are a soup (`python -m leapfrog.train.soup`): {parts}"
    init = summary.get("init")
    if not init:
        return f"trained from scratch by `leapfrog train {summary['recipe']}`"
    return (f"initialised from `{init['folder']}` and trained by `leapfrog train {summary['recipe']}`"
            + (" into a block-diffusion model" if summary["config"].get("diffusion") else ""))


def _loss_rows(summary: dict) -> list[str]:
    if not summary["config"].get("diffusion"):
        label, where = "final validation loss", ""
        if summary.get("exported_step") is not None:     # keep_best: the best step's weights ship
            label, where = "validation loss", f", the best, at step {summary['exported_step']:,} (these weights)"
        return [f"| {label} | {summary['val_loss']} nats/token (perplexity {summary['val_ppl']}){where} |",
                *_mix_row(summary), *_initial_model_row(summary)]
    rows = [f"| final validation loss | {summary['val_loss']} nats per masked token (the training mix) |"]
    labels = {"single": "single-block (complementary masks)", "multi": "multi-block (MultiTF groups)"}
    for key, label in labels.items():
        if key in summary.get("val_parts", {}):
            before = (summary.get("init") or {}).get("val_parts", {}).get(key)
            rows.append(f"| validation, {label} | {summary['val_parts'][key]}"
                        + (f" (initial model: {before})" if before is not None else "") + " |")
    return rows + _initial_model_row(summary)


def _mix_row(summary: dict) -> list[str]:
    cfg = summary["config"]
    rows = []
    if cfg.get("mix"):
        parts = ", ".join(f"{share:.0%} of the windows from `{source}`" for source, share in cfg["mix"])
        rows.append(f"| mixed in (training only) | {parts} |")
    if cfg.get("dropout"):
        rows.append(f"| dropout | {cfg['dropout']} on the residual branches and the embeddings |")
    return rows


def _initial_model_row(summary: dict) -> list[str]:
    init = summary.get("init") or {}
    if "steps" not in init:
        return []
    return [f"| initial model | `{init['folder']}`: recipe {init.get('recipe')}, {init['steps']:,} "
            f"steps, {init.get('wall_s', 0) / 60:.1f} min, validation loss {init.get('val_loss')} |"]


def _coupled_section(anchor: str) -> list[str]:
    return ["## Positions", "",
            f"Trained with coupled positions: the rotary positions restart after the first `{anchor}` "
            "of each example, so the answer's j-th token sits at the position of the prompt's j-th "
            f"(`leapfrog.json`: `\"coupled_positions\": \"{anchor}\"`). leapfrog reads that and decodes "
            "it so. transformers' `generate` and llama.cpp number positions 0..n-1 and decode this "
            "checkpoint wrongly; with transformers, pass `position_ids` (as `leapfrog.train.check` does).",
            ""]


def _diffusion_section(summary: dict, folder: Path) -> list[str]:
    # deferred: the diffusion code loads only for diffusion summaries
    from leapfrog.train.diffusion import DiffusionSpec, notes

    spec = DiffusionSpec(**summary["config"]["diffusion"])
    init = summary.get("init") or {}
    stages = ([f"Continued from a block-diffusion model: `leapfrog train {init['recipe']}` wrote "
               f"`{init['folder']}`, then `leapfrog train {summary['recipe']}` continued it into "
               "this folder.", ""]
              if init.get("val_parts") else [])
    if summary["config"].get("mask_stream_from"):
        stages += [f"The mask stream started as a copy of `{_repo_relative(summary['config']['mask_stream_from'])}`'s "
                   "layers, final norm and mask-token embedding (a block-diffusion model of the same "
                   "shape); the frozen parent is the model this folder was initialised from.", ""]
    distill = summary["config"].get("distill")
    if distill:
        parent = _repo_relative(distill["parent"])
        stages += [f"Self-distillation (`leapfrog.train.distill`): the training stream is not the "
                   f"corpus but `{parent}`'s own continuations of "
                   f"{distill['num_sequences']:,} training-story openings ({distill['max_tokens']} "
                   + (f"tokens each; one in {distill['sampled_every']} at T=0.7 / top-p 0.9, the rest "
                      "greedy)" if distill["sampled_every"] else "tokens each, greedy)")
                   + ". Validation is still held-out human text.", ""]
    return ["## Block diffusion", "", *notes(spec), "", *stages,
            "Decoding contract: `config.json` carries `block_size`, `mask_token_id` and "
            "`diffusion_logit_shift`; `leapfrog.json` makes `diffusion` the default method. "
            "Validation uses fixed windows and noise: the single-block loss over a complementary "
            "pair (every token a target once), the multi-block loss over MultiTF views. "
            "Tokens/s in the log count window tokens; the model processes each window "
            "(views + clean copy) several times over.", "",
            "```python", "from leapfrog import LLM, SamplingParams",
            f'llm = LLM("{_model_name(folder)}", method="diffusion", num_blocks=3, threshold=0.9)',
            "```", ""]


def _repo_relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return path


def _model_name(folder: Path) -> str:
    """The built-in name of a folder under checkpoints/, else its path from the repository root."""
    folder = Path(folder).resolve()
    if folder.parent.name == "checkpoints":
        return folder.name
    try:
        return str(folder.relative_to(REPO_ROOT))
    except ValueError:
        return str(folder)


def _architecture(m: dict) -> str:
    if m.get("num_experts"):
        return "mixture-of-experts Qwen3-MoE (`Qwen3MoeForCausalLM`"
    return "Llama (`LlamaForCausalLM`"


def _mlp(m: dict, folder: Path) -> str:
    if not m.get("num_experts"):
        return f"MLP {m['intermediate_size']}"
    # deferred: models.info (torch) loads only for MoE models
    from leapfrog.models.info import param_report

    active = param_report(json.loads((Path(folder) / "config.json").read_text())).active
    return (f"MLP: {m['num_experts']} SwiGLU experts of width {m['moe_intermediate_size']}, "
            f"{m['num_experts_per_tok']} per token, so {active / 1e6:.2f}M parameters active per token")


def _loaders(m: dict) -> str:
    if m.get("num_experts"):
        return ("transformers and leapfrog load the folder as is (llama.cpp's converter was not "
                "checked on it).")
    return ("transformers loads the folder as is, and llama.cpp's `convert_hf_to_gguf.py` (checked "
            "with the copy in the llama-cpp-python 0.3.36 sources) converts it to GGUF.")


def _samples(check: CheckResult, limit: int = 18) -> list[str]:
    out = []
    for s in check.samples[:limit] if check.name == "couplets" else check.samples[:8]:
        prompt = s["prompt"].replace("\n", "\\n")
        out += [f"- prompt: `{prompt}`", f"  - completion: {s['completion']!r}"]
        if "reference" in s:
            out.append(f"  - reference: {s['reference']}")
    return out + [""]


def finish_folder(cfg, summary: dict, measure: bool = True) -> CheckResult:
    """Measure the exported folder (or reuse the stored measurement), write README.md, refresh
    SHA256SUMS."""
    folder = Path(cfg.out_dir)
    if measure or "check_samples" not in summary:
        check = run_check(cfg.name, str(folder), cfg.data_dir)
    else:
        check = CheckResult(cfg.name, summary["check"], summary["check_samples"])
    summary = dict(summary, check=check.metrics, check_samples=check.samples)
    (folder / "training.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False, default=str))
    (folder / "README.md").write_text(render(summary, check, folder))
    write_sha256sums(folder)
    return check


def refresh_folder(folder: str | Path, summary: dict, measure: bool = True) -> CheckResult:
    """finish_folder for a folder known by its training summary alone (no TrainConfig at hand)."""
    # deferred: train.loop loads only when a folder is refreshed
    from leapfrog.train.loop import TrainConfig

    c = summary["config"]
    cfg = TrainConfig(name=c["name"], out_dir=str(folder), run_dir=c["run_dir"], data_dir=c["data_dir"])
    return finish_folder(cfg, summary, measure=measure)


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(1)
    p = argparse.ArgumentParser(description="Rewrite a checkpoint folder's README.md and SHA256SUMS.")
    p.add_argument("folder")
    p.add_argument("--no-measure", action="store_true", help="reuse the measurement in training.json")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    summary = json.loads((folder / "training.json").read_text())
    check = refresh_folder(folder, summary, measure=not args.no_measure)
    print(json.dumps(asdict(check), ensure_ascii=False, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
