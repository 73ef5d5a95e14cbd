"""Training pipeline: the loop learns, the exported folder loads in transformers, the manifest is
right, and a resumed run continues where the saved one stopped. Synthetic data, seconds to run."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from leapfrog.data import couplets as fmt
from leapfrog.train import couplets as examples
from leapfrog.data import corpus as data
from leapfrog.train.export import verify_sha256sums
from leapfrog.train.loop import ModelShape, build_model, loss_on, make_optimizer, train
from leapfrog.train.recipes import tiny


# data_dir (a miniature copy of the shared data layout) and private_cache (token caches under
# the test's tmp_path) come from conftest.py.
pytestmark = pytest.mark.usefixtures("private_cache")


def test_loss_falls_on_a_repeated_batch():
    torch.manual_seed(0)
    model = build_model(ModelShape(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                   intermediate_size=64, max_position=32), vocab_size=64)
    cfg = tiny()
    opt = make_optimizer(model, cfg)
    x = torch.randint(0, 64, (4, 17))
    first = None
    for _ in range(30):
        loss = loss_on(model, x[:, :-1], x[:, 1:], "fp32")
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < first - 1.0


def test_heldout_is_deterministic_and_disjoint(data_dir):
    for name in ("stories", "couplets"):
        held = data.heldout(name, str(data_dir))
        assert held and held == data.heldout(name, str(data_dir))
    held_ups = {u for u, _ in data.heldout("couplets", str(data_dir))}
    train = data.train_items("couplets", str(data_dir))
    assert not held_ups & {u for u, _ in train["pairs"]}
    assert all(isinstance(p, tuple) and len(p) == 2 for p in data.heldout("couplets", str(data_dir)))
    assert not set(data.heldout("stories", str(data_dir))) & set(data.train_items("stories", str(data_dir))["stories"])


def test_couplet_formats_round_trip():
    rng = random.Random(1)
    keywords = fmt.sample_keywords("天若有情天亦老", "月如无恨月常圆", rng)
    assert all(k in "天若有情天亦老" or k in "月如无恨月常圆" for k in keywords)
    text = fmt.keyword_text(keywords, "天若有情天亦老", "月如无恨月常圆", "花好月圆")
    # The prompt, then the <sep> the couplets tokenizer ends every prompt with, then the completion.
    prompt = fmt.keyword_prompt(keywords)
    assert text.startswith(prompt + fmt.SEP + fmt.UP)
    completion = text[len(prompt + fmt.SEP):]
    assert completion == fmt.keyword_completion("天若有情天亦老", "月如无恨月常圆", "花好月圆")
    assert fmt.parse_keyword_completion(completion) == {"上联": "天若有情天亦老", "下联": "月如无恨月常圆", "横批": "花好月圆"}
    assert fmt.pair_text("天若有情", "月如无恨") == "天若有情<sep>月如无恨"
    assert examples.ScrollPool(["花好月圆", "万象更新"]).pick("花开富贵", "月满乾坤") == "花好月圆"


def test_long_couplets_are_oversampled_in_pair_mode_only():
    """long_repeats adds that many pair-mode copies of every pair with a long 上联, and nothing
    else: the examples without it are the same multiset as before."""
    from collections import Counter
    pairs = [("天若有情天亦老", "月如无恨月常圆"), ("春风又绿江南岸呀", "明月何时照我还呢"), ("山高", "水长")]
    spring = [("福满门", "春满园", "万象更新")]
    base = examples.build_examples(pairs, spring, seed=3, spring_repeats=1)
    more = examples.build_examples(pairs, spring, seed=3, spring_repeats=1, long_repeats=2)
    extra = Counter(more) - Counter(base)
    assert extra == Counter({fmt.pair_text("春风又绿江南岸呀", "明月何时照我还呢"): 2})
    assert not Counter(base) - Counter(more)


def test_oversampling_long_couplets_keeps_the_vocabulary(data_dir, tmp_path):
    """prepare(long_repeats=2): two more copies of each long pair in the training stream, the
    tokenizer trained on the plain examples (so continued training keeps its embedding)."""
    import shutil

    from leapfrog.train.prepare import prepare
    root = tmp_path / "data"
    shutil.copytree(data_dir, root)
    long_pairs = [("天地山水风月花鸟春秋", "日月云雨江河金玉龙凤"), ("福寿喜乐东西南北天地", "山水风月花鸟春秋日月")]
    with open(root / "couplets" / "couplets.tsv", "a") as f:
        f.writelines(f"{u}\t{d}\n" for u, d in long_pairs)
    cfg = tiny("couplets")
    plain = prepare("couplets", cfg.tokenizer, str(root), cfg.seed, cfg.model.max_position)
    more = prepare("couplets", cfg.tokenizer, str(root), cfg.seed, cfg.model.max_position, long_repeats=2)
    held = set(data.heldout("couplets", str(root)))
    num_long = sum((u, d) not in held for u, d in long_pairs)
    assert num_long > 0 and more.num_train_items == plain.num_train_items + 2 * num_long
    assert len(more.train) > len(plain.train)
    assert (more.tokenizer_dir / "tokenizer.json").read_text() == (plain.tokenizer_dir / "tokenizer.json").read_text()


def test_couplets_tokenizer_ends_prompts_with_sep_but_not_training_streams(data_dir):
    """The couplets recipe's tokenizer encodes a raw prompt as <s> prompt <sep> in transformers
    and in leapfrog alike, while the token streams it trains on hold only the texts' own <sep>s."""
    from transformers import AutoTokenizer

    from leapfrog.tokenizer import Tokenizer
    from leapfrog.train.prepare import _texts, prepare

    cfg = tiny("couplets")
    prep = prepare("couplets", cfg.tokenizer, str(data_dir), cfg.seed, cfg.model.max_position)
    hf, ours = AutoTokenizer.from_pretrained(prep.tokenizer_dir), Tokenizer.from_folder(prep.tokenizer_dir)
    sep = hf.convert_tokens_to_ids(fmt.SEP)
    config = json.loads((prep.tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "add_bos_token" not in config
    for prompt in ("天地山水风", fmt.keyword_prompt(["春", "福"])):
        plain = hf(prompt, add_special_tokens=False).input_ids
        assert hf(prompt).input_ids == ours.encode(prompt) == [1, *plain, sep]
        assert hf.decode(hf(prompt).input_ids, skip_special_tokens=True) == prompt
    train_texts, val_texts, _ = _texts("couplets", str(data_dir), cfg.seed)
    for stream, texts in ((prep.train, train_texts), (prep.val, val_texts)):
        assert int((stream == sep).sum()) == sum(t.count(fmt.SEP) for t in texts)
        assert int((stream == 1).sum()) == len(texts)
    # A few pair examples carry <sep><sep> (clients that still write "<sep>" themselves).
    assert any(fmt.SEP * 2 in t for t in train_texts)


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """One tiny stories run shared by the export tests (the slow part, a few seconds)."""
    root = tmp_path_factory.mktemp("tiny")
    cfg = tiny("stories", root / "out", root / "run")
    cfg.data_dir, cfg.max_steps = str(data_dir), 6
    import leapfrog.data.corpus as d
    old = d.CACHE_DIR
    d.CACHE_DIR = root / "cache"
    try:
        summary = train(cfg)
    finally:
        d.CACHE_DIR = old
    return cfg, summary


def test_folder_loads_in_transformers(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, summary = trained
    tok = AutoTokenizer.from_pretrained(cfg.out_dir)
    model = AutoModelForCausalLM.from_pretrained(cfg.out_dir, dtype=torch.float32)
    assert len(tok) == model.config.vocab_size > 100  # not the 3-token trap
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.convert_tokens_to_ids("<mask>") == 3
    ids = tok("The cat ran", return_tensors="pt").input_ids
    assert ids[0, 0].item() == 1 and tok.decode(ids[0], skip_special_tokens=True) == "The cat ran"
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert json.loads((Path(cfg.out_dir) / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert summary["steps"] == 6 and summary["val_loss"] > 0


def test_sha256sums_cover_the_folder(trained):
    cfg, _ = trained
    folder = Path(cfg.out_dir)
    listed = {line.split("  ", 1)[1] for line in (folder / "SHA256SUMS").read_text().splitlines()}
    assert listed == {p.name for p in folder.iterdir() if p.name != "SHA256SUMS"}
    assert verify_sha256sums(folder) == []
    (folder / "config.json").write_text((folder / "config.json").read_text() + " ")
    assert verify_sha256sums(folder) == ["config.json"]


def test_resume_continues_from_saved_step(trained, capsys):
    cfg, _ = trained
    saved = torch.load(Path(cfg.run_dir) / "state.pt", weights_only=False)
    assert saved["step"] == 6
    cfg.max_steps = 9
    summary = train(cfg, resume=True)
    assert "resumed from" in capsys.readouterr().out
    state = torch.load(Path(cfg.run_dir) / "state.pt", weights_only=False)
    steps = [s for s, _ in state["history"]["train"]]
    assert steps == list(range(1, 10)) and summary["steps"] == 9
    # The first six losses are the saved run's, not recomputed.
    assert state["history"]["train"][:6] == saved["history"]["train"]


def test_distilled_stream_is_the_parents_own_text(trained, data_dir, monkeypatch):
    """train.distill: the training stream becomes the parent's continuations of training-story
    openings (<s> prompt completion), greedy ones equal to the parent's greedy generation, and a
    second call reads the cache instead of generating again."""
    from leapfrog import LLM, SamplingParams
    from leapfrog.train import distill
    from leapfrog.train.prepare import prepare

    cfg, _ = trained
    prep = prepare("stories", cfg.tokenizer, str(data_dir), cfg.seed, cfg.model.max_position)
    spec = distill.DistillSpec(parent=cfg.out_dir, num_sequences=3, max_tokens=6, sampled_every=0)
    out = distill.distilled(prep, "stories", spec, cfg.seed, str(data_dir))
    stream = [int(t) for t in out.train]
    assert stream[0] == 1 and out.num_train_items == 3 and out.val is prep.val
    prompts = distill.prompts_for("stories", spec, cfg.seed, str(data_dir))
    llm = LLM(cfg.out_dir, method="ar")
    expected = []
    for o in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0)):
        expected += list(o.prompt_token_ids) + list(o.token_ids)
    assert stream == expected

    def no_generation(*args, **kwargs):
        raise AssertionError("regenerated although cached")
    monkeypatch.setattr(distill, "regenerate", no_generation)
    again = distill.distilled(prep, "stories", spec, cfg.seed, str(data_dir))
    assert [int(t) for t in again.train] == stream


def test_rare_character_pairs_reach_the_model_as_byte_fallback(data_dir):
    """couplets.with_rare_chars: 上联 with 1-2 characters outside the vocabulary (each encoded
    as its three UTF-8 bytes), the 下联 and the punctuation untouched, appended to the stream."""
    import random as _random

    from transformers import AutoTokenizer

    from leapfrog.train import couplets
    from leapfrog.train.prepare import prepare

    cfg = tiny("couplets")
    prep = prepare("couplets", cfg.tokenizer, str(data_dir), cfg.seed, cfg.model.max_position)
    tok = AutoTokenizer.from_pretrained(prep.tokenizer_dir)
    in_vocab = {p for p in tok.get_vocab() if len(p) == 1}
    pairs = data.train_items("couplets", str(data_dir))["pairs"]
    made = couplets.rare_char_pairs(pairs, 50, _random.Random(0), in_vocab)
    assert len(made) == 50
    originals = {d: u for u, d in pairs}
    for up, down in made:
        src = originals[down]
        changed = [i for i, (a, b) in enumerate(zip(up, src)) if a != b]
        assert len(up) == len(src) and 1 <= len(changed) <= 2
        assert all(up[i] not in in_vocab and src[i] not in couplets.PUNCT for i in changed)
        assert all(len(tok(up[i], add_special_tokens=False).input_ids) == 3 for i in changed)   # its bytes
    out = couplets.with_rare_chars(prep, "couplets", 50, cfg.seed, str(data_dir))
    base = len(prep.train)
    assert [int(t) for t in out.train[:base]] == [int(t) for t in prep.train]
    assert out.num_train_items == prep.num_train_items + 50
    tail = tok.decode([int(t) for t in out.train[base:]], skip_special_tokens=False)
    assert tail.count("<sep>") == 50


def test_couplets_tokenizer_without_byte_fallback_gives_a_rare_character_one_unk(data_dir, tmp_path):
    """TokenizerSpec.byte_fallback=False: the same vocabulary and ids as the byte-fallback
    tokenizer of the spec, but a character outside it is one <unk> (not 3 byte tokens) in
    transformers, in leapfrog's tokenizer and in SentencePiece's tokenizer.model; the
    rare-character pairs then cost one position per rare character. A model continued from a
    byte-fallback folder with such a spec is saved with the <unk> rule."""
    import dataclasses
    import random as _random

    import sentencepiece as spm
    from transformers import AutoTokenizer

    from leapfrog.tokenizer import Tokenizer
    from leapfrog.train.prepare import prepare

    cfg = tiny("couplets", tmp_path / "out", tmp_path / "run")
    cfg.data_dir, cfg.max_steps = str(data_dir), 2
    train(cfg)
    spec = dataclasses.replace(cfg.tokenizer, byte_fallback=False)
    bytes_prep = prepare("couplets", cfg.tokenizer, str(data_dir), cfg.seed, cfg.model.max_position)
    prep = prepare("couplets", spec, str(data_dir), cfg.seed, cfg.model.max_position)
    old, tok = AutoTokenizer.from_pretrained(bytes_prep.tokenizer_dir), AutoTokenizer.from_pretrained(prep.tokenizer_dir)
    assert tok.get_vocab() == old.get_vocab()
    in_vocab = {p for p in tok.get_vocab() if len(p) == 1}
    rare = [chr(c) for c in range(0x4E00, 0x9FA6) if chr(c) not in in_vocab][:2]
    common = next(c for c in "天地山水风月花" if c in in_vocab)
    text = f"{common}{rare[0]}{common}{rare[0]}{rare[1]}"
    plain = old(common, add_special_tokens=False).input_ids
    assert len(old(text, add_special_tokens=False).input_ids) == 2 * len(plain) + 9     # bytes
    want = [*plain, 0, *plain, 0, 0]
    assert tok(text, add_special_tokens=False).input_ids == want
    assert Tokenizer.from_folder(prep.tokenizer_dir).encode(text, add_special_tokens=False) == want
    sp = spm.SentencePieceProcessor(model_file=str(prep.tokenizer_dir / "tokenizer.model"))
    assert sp.encode(f"{common}{rare[0]}{common}") == [*plain, 0, *plain]   # (it fuses a run of them)
    # rare-character pairs: each replaced character is one <unk>
    pairs = data.train_items("couplets", str(data_dir))["pairs"]
    for up, _ in examples.rare_char_pairs(pairs, 20, _random.Random(0), in_vocab):
        assert len(tok(up, add_special_tokens=False).input_ids) == len(up)
    # continued from the byte-fallback model: the saved folder encodes with the <unk> rule
    cont = tiny("couplets", tmp_path / "out2", tmp_path / "run2")
    cont.data_dir, cont.max_steps, cont.tokenizer, cont.init_from = str(data_dir), 1, spec, str(tmp_path / "out")
    train(cont)
    saved = AutoTokenizer.from_pretrained(tmp_path / "out2")
    assert saved.get_vocab() == old.get_vocab()
    assert saved(text, add_special_tokens=False).input_ids == want
    assert AutoTokenizer.from_pretrained(tmp_path / "out")(text, add_special_tokens=False).input_ids != want


def test_weight_averaging_exports_the_mean_of_the_tail_steps(data_dir, tmp_path, monkeypatch):
    """TrainConfig.average_from: the exported weights are the mean of the weights after each
    step from that fraction of max_steps on (recorded here as the steps are taken), and a run
    without it exports the last step's."""
    from safetensors.torch import load_file

    from leapfrog.train import loop

    seen: list[dict] = []
    add = loop.WeightAverage.add

    def recording_add(self, model):
        seen.append({n: p.detach().clone() for n, p in model.named_parameters()})
        add(self, model)

    monkeypatch.setattr(loop.WeightAverage, "add", recording_add)
    cfg = tiny("stories", tmp_path / "out", tmp_path / "run")
    cfg.data_dir, cfg.max_steps, cfg.average_from, cfg.save_dtype = str(data_dir), 6, 0.5, "float32"
    summary = train(cfg)
    assert len(seen) == 4                          # after steps 3, 4, 5 and 6 (ceil(0.5 * 6) = 3 on)
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, tensor in saved.items():
        want = torch.stack([s[name] for s in seen]).mean(0)
        assert torch.allclose(tensor, want, atol=1e-6), name
        assert not torch.equal(tensor, seen[-1][name])
    assert summary["steps"] == 6


def test_train_help_lists_every_recipe_with_its_one_description():
    """A recipe is described once, by its function's docstring; `leapfrog train --help` reads it."""
    from leapfrog.train.cli import build_parser
    from leapfrog.train.recipes import RECIPES, describe

    text = build_parser().format_help()
    for name, make in RECIPES.items():
        assert describe(name) and make.__doc__.strip().startswith(describe(name))
        assert f"  {name}: {describe(name)}\n" in text


def test_kill_9_mid_run_resumes_on_the_uninterrupted_curve(data_dir, tmp_path):
    """A training process killed with SIGKILL (no chance to save) resumes from its last
    checkpoint; with the same flags the resumed run's losses are, step for step, those of a run
    that was never interrupted."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import leapfrog.data.corpus as d

    def config(root: Path):
        cfg = tiny("stories", root / "out", root / "run")
        cfg.data_dir, cfg.max_steps, cfg.ckpt_interval, cfg.eval_interval, cfg.threads = str(data_dir), 150, 5, 50, 1
        return cfg
    reference = train(config(tmp_path / "a"))
    want = torch.load(tmp_path / "a" / "run" / "state.pt", weights_only=False)["history"]["train"]

    root = tmp_path / "b"
    launcher = ("import sys; from pathlib import Path; import leapfrog.data.corpus as d; "
                f"d.CACHE_DIR = Path({str(d.CACHE_DIR)!r}); from leapfrog.train.cli import main; main(sys.argv[1:])")
    proc = subprocess.Popen([sys.executable, "-c", launcher, "tiny", "--data-dir", str(data_dir), "--run-dir",
                             str(root / "run"), "--out", str(root / "out"), "--steps", "150", "--ckpt-interval", "5",
                             "--eval-interval", "50", "--threads", "1", "--no-readme"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = root / "run" / "state.pt"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if state.is_file() and torch.load(state, weights_only=False)["step"] >= 10:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = torch.load(state, weights_only=False)["step"]
    assert 10 <= saved < 150 and saved % 5 == 0
    summary = train(config(root), resume=True)
    got = torch.load(state, weights_only=False)["history"]["train"]
    assert [s for s, _ in got] == list(range(1, 151))
    assert got == want and summary["val_loss"] == reference["val_loss"]


def test_a_couplets_export_never_generates_its_end_of_prompt_marker(data_dir, tmp_path, monkeypatch):
    """The couplets tokenizer ends every prompt with <sep> and no completion holds one: the export
    lists it under generation_config.json's suppress_tokens, which leapfrog and transformers obey."""
    import leapfrog.data.corpus as d
    from transformers import AutoTokenizer
    from leapfrog import LLM, SamplingParams

    monkeypatch.setattr(d, "CACHE_DIR", tmp_path / "cache")
    cfg = tiny("couplets", tmp_path / "couplets", tmp_path / "run")
    cfg.data_dir, cfg.max_steps = str(data_dir), 2
    train(cfg)
    sep = AutoTokenizer.from_pretrained(cfg.out_dir).convert_tokens_to_ids(fmt.SEP)
    gen = json.loads((Path(cfg.out_dir) / "generation_config.json").read_text())
    assert gen["suppress_tokens"] == [sep]
    out = LLM(cfg.out_dir).generate(["天地山水"], SamplingParams(max_tokens=24, temperature=1.0, seed=0,
                                                             ignore_eos=True, logprobs=20))[0]
    assert sep not in out.token_ids and all(sep not in dict(e["top"]) for e in out.logprobs)


def test_a_stories_export_suppresses_nothing(trained):
    cfg, _ = trained
    assert "suppress_tokens" not in json.loads((Path(cfg.out_dir) / "generation_config.json").read_text())


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps 0: must be at least 1"),        # once wrote a model with val loss nan
    (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
    (["--seq-len", "1"], "--seq-len 1: must be at least 2"),
    (["--eval-interval", "0"], "--eval-interval 0: must be at least 1"),   # once ZeroDivisionError
    (["--threads", "0"], "--threads 0: must be at least 1"),
    (["--lr", "-1"], "--lr -1.0: must be a positive number"),   # once silently raised to min_lr
    (["--dropout", "1"], "--dropout 1.0: must be in [0, 1)"),
    (["--dropout", "-0.1"], "--dropout -0.1: must be in [0, 1)"),
    (["--weight-decay", "nan"], "--weight-decay nan: must be a number >= 0"),
    (["--dropout", "0.2"], "--dropout: recipe tiny runs the plain forward"),
    (["--unlikelihood", "-1"], "--unlikelihood -1.0: must be a number >= 0"),
    (["--unlikelihood", "inf"], "--unlikelihood inf: must be a number >= 0"),
    (["--unlikelihood", "2"], "--unlikelihood: recipe tiny runs the plain forward"),
])
def test_train_flags_out_of_range_are_usage_errors(flags, message, capsys):
    from leapfrog.train.cli import config_for
    with pytest.raises(SystemExit) as e:
        config_for(["tiny"] + flags)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_dropout_and_weight_decay_flags_reach_the_config():
    from leapfrog.train.cli import config_for
    cfg, _ = config_for(["stories", "--dropout", "0.25", "--weight-decay", "0.2"])
    assert (cfg.dropout, cfg.weight_decay) == (0.25, 0.2)
    assert "--dropout 0.25" in cfg.command


def test_unlikelihood_flag_overrides_the_recipes_weight():
    from leapfrog.train.cli import config_for
    assert config_for(["stories-context"])[0].unlikelihood == 1.0
    cfg, _ = config_for(["stories-context", "--unlikelihood", "3"])
    assert cfg.unlikelihood == 3.0 and "--unlikelihood 3" in cfg.command
    assert config_for(["stories-context", "--unlikelihood", "0"])[0].unlikelihood == 0.0


def test_every_recipe_passes_the_flag_checks():
    from leapfrog.train.cli import config_for
    from leapfrog.train.recipes import RECIPES
    for name in RECIPES:
        cfg, _ = config_for([name])
        assert cfg.max_steps >= 1


def test_a_missing_data_folder_is_an_error_not_a_traceback(tmp_path, capsys):
    from leapfrog.train.cli import main
    rc = main(["tiny", "--data-dir", str(tmp_path / "none"), "--out", str(tmp_path / "o"),
               "--run-dir", str(tmp_path / "r"), "--steps", "1"])
    assert rc == 2 and "none does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
