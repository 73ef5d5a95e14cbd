"""Tiny random checkpoints of each supported family, written in Hugging Face format by
`transformers` itself, so loaders are checked against the real format."""
from __future__ import annotations

import json
import zlib
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))

VOCAB = 384
TEXT = ("Once upon a time there was a little cat. The cat liked to play in the sun. "
        "One day the cat met a big dog. They became friends and played all day. "
        "春回大地万象新，福满人间百业兴。") * 4


def write_tokenizer(folder: Path, vocab_size: int = VOCAB) -> None:
    """A byte-level BPE tokenizer.json with <s>, </s>, <pad>, <mask> specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<mask>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "mask_token": "<mask>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}"}))


def _common(**kw):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(kw)
    return base


def build_model(root: Path, family: str, **overrides) -> Path:
    import transformers as tf
    cls_cfg, cls_model = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[family]
    kw = _common(**overrides)
    if family == "qwen3":
        kw.setdefault("head_dim", 32)
    if family == "qwen2":
        kw.setdefault("tie_word_embeddings", True)
    torch.manual_seed(zlib.crc32(family.encode()) % 1000)   # stable across processes
    model = cls_model(cls_cfg(**kw)).eval()
    with torch.no_grad():    # random init is tiny; scale up so logits are not all ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    folder = root / family
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


WORDS = "the cat dog girl boy sun tree ball happy sad ran jumped saw played with a big small red".split()
HAN = "天地山水风月花鸟春秋日月云雨江河金玉龙凤福寿喜乐东西南北"


def write_mini_data(root: Path) -> Path:
    """A miniature, synthetic copy of the ../shared/data layout (stories and couplets)."""
    import random
    rng = random.Random(0)
    (root / "stories").mkdir(parents=True, exist_ok=True)
    for fname, n in (("tinystories_cased.txt", 300), ("tinystories_valid.txt", 60)):
        stories = []
        for i in range(n):
            lines = [" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + "."
                     for _ in range(rng.randint(1, 3))]
            stories.append(f"Story {fname[:4]} {i}.\n" + "\n".join(lines) + "\n<|endoftext|>\n")
        (root / "stories" / fname).write_text("".join(stories))
    chapters = [f"Chapter {i}\n" + " ".join(rng.choice(WORDS).upper() for _ in range(40)) + ".\n<|endoftext|>\n"
                for i in range(30)]           # the training-only classics, in capitals
    (root / "stories" / "classics.txt").write_text("".join(chapters))
    (root / "couplets").mkdir(exist_ok=True)
    side = lambda n: "".join(rng.choice(HAN) for _ in range(n))  # noqa: E731
    pairs = [f"{side(n)}\t{side(n)}\n" for n in (rng.choice((5, 7)) for _ in range(400))]
    (root / "couplets" / "couplets.tsv").write_text("".join(pairs))
    (root / "couplets" / "spring_festival.tsv").write_text(
        "".join(f"{side(7)}\t{side(7)}\t{side(4)}\n" for _ in range(20)))
    return root


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A miniature copy of the shared data layout, one per test module."""
    return write_mini_data(tmp_path_factory.mktemp("data"))


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """Token caches under the test's own tmp_path, never the repository's data_cache/."""
    from leapfrog.data import corpus
    monkeypatch.setattr(corpus, "CACHE_DIR", tmp_path / "cache")


@pytest.fixture(scope="session", autouse=True)
def data_folder(tmp_path_factory) -> Path:
    """Tests never read the real ../shared/data: code that looks for it by default
    ($LEAPFROG_DATA_DIR) gets the miniature copy, so a clone anywhere runs the suite."""
    root = write_mini_data(tmp_path_factory.mktemp("shared_data"))
    old = os.environ.get("LEAPFROG_DATA_DIR")
    os.environ["LEAPFROG_DATA_DIR"] = str(root)
    yield root
    if old is None:
        os.environ.pop("LEAPFROG_DATA_DIR", None)
    else:
        os.environ["LEAPFROG_DATA_DIR"] = old


@pytest.fixture(scope="module")
def one_thread():
    """Many small ops per step: with 2 OpenMP threads on a shared 2-core box (libgomp's long
    default spin: nothing sets GOMP_SPINCOUNT in the test process) these tests ran 2-50x
    slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def llama_dir(model_root) -> Path:
    return build_model(model_root, "llama")


@pytest.fixture(scope="session")
def family_dirs(model_root, llama_dir) -> dict[str, Path]:
    return {"llama": llama_dir, "qwen2": build_model(model_root, "qwen2"),
            "qwen3": build_model(model_root, "qwen3")}


@pytest.fixture
def fake_clock(monkeypatch):
    """The verify policies' clock moves 1 µs per reading: confidence scheduling's decisions then
    rest on the step costs a test gives, not on this machine's load."""
    import types

    import leapfrog.methods.verify as verify_mod
    ticks = iter(range(10**9))
    monkeypatch.setattr(verify_mod, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) * 1e-6))


@pytest.fixture
def bf16_products(monkeypatch):
    """bfloat16 products on any CPU: without AVX512-BF16 the engine would fall back to float32,
    so the kernels' scalar loop (the instruction's order, the same bits) stands in for it."""
    from leapfrog.layers import linear
    monkeypatch.setattr(linear, "bf16_products_available", lambda: True)


@pytest.fixture(scope="session")
def draft_dir(llama_dir, tmp_path_factory) -> Path:
    """`llama_dir` with noise on its weights: a draft model that agrees with it on some tokens only."""
    import shutil

    import transformers
    folder = tmp_path_factory.mktemp("draft") / "llama-noisy"
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / f, folder / f)
    return folder
