"""leapfrog vs transformers on tiny random checkpoints of each family (the oracle)."""
from __future__ import annotations

import pytest
import torch
import transformers

from conftest import build_model
from leapfrog import LLM, SamplingParams
from leapfrog.models.loader import load_model

PROMPTS = [[1, 5, 9], [1] + list(range(20, 57)), [1, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], [1, 300],
           [1] + list(range(100, 119)), [1, 42, 43, 44, 45], [1] + list(range(200, 264)), [1, 3]]


def hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def record_logits(llm: LLM) -> dict[str, list[torch.Tensor]]:
    """Wrap the method's commit to keep every logits row each request received."""
    seen: dict[str, list[torch.Tensor]] = {}
    method = llm.engine.method
    inner = method.commit

    def commit(batch, out):
        for item, rows in zip(batch.seqs, out.split(batch)):
            if item.num_logits:
                seen.setdefault(item.seq.request_id, []).append(rows[-1].clone())
        return inner(batch, out)
    method.commit = commit
    return seen


@pytest.mark.parametrize("path", ["layers", "loop"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_logits_match_at_prefill_and_every_decode_step(family_dirs, family, path, monkeypatch):
    """Every decode step's logits, from the layer-by-layer path or from the C++ decode loop
    (asked for logprobs, it hands each step's logits back to the method)."""
    from leapfrog.engine import decode_loop
    monkeypatch.setattr(decode_loop, "ENABLED", path == "loop")
    folder = family_dirs[family]
    llm = LLM(str(folder), block_size=4)
    seen = record_logits(llm)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0 if path == "loop" else None)
    outs = llm.generate(PROMPTS[:4], params)
    if path == "loop":
        assert llm.engine.decode_loop.num_calls > 0
    ref = hf_model(folder)
    for out in outs:
        full = torch.tensor([out.prompt_token_ids + out.token_ids])
        with torch.no_grad():
            ref_logits = ref(full).logits[0]
        steps = seen[out.request_id]
        assert len(steps) == 6
        n0 = len(out.prompt_token_ids)
        for i, got in enumerate(steps):
            torch.testing.assert_close(got, ref_logits[n0 - 1 + i], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_matches_transformers_generate(family_dirs, family, batch):
    folder = family_dirs[family]
    llm = LLM(str(folder), block_size=8, enable_prefix_caching=False)
    ref = hf_model(folder)
    prompts = PROMPTS[:batch]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ref, prompt, 12)
        assert out.metrics.num_forwards == 12 and out.metrics.tokens_per_forward == 1.0


def test_batching_chunking_and_prefix_cache_do_not_change_results(llama_dir):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    alone = [LLM(str(llama_dir), enable_prefix_caching=False).generate([p], params)[0].token_ids
             for p in PROMPTS[:3]]
    shared = [[1] + list(range(20, 57)) + tail for tail in ([5], [6, 7], [300, 301, 302])]
    llm = LLM(str(llama_dir), block_size=4, max_num_batched_tokens=16)   # chunked prefill
    first = llm.generate(PROMPTS[:3] + shared, params)
    second = llm.generate(PROMPTS[:3] + shared, params)                  # prefix-cache hits
    assert [o.token_ids for o in first[:3]] == alone
    assert [o.token_ids for o in second] == [o.token_ids for o in first]
    assert all(o.metrics.num_cached_prompt_tokens > 0 for o in second if len(o.prompt_token_ids) > 4)
    ref = hf_model(llama_dir)
    for prompt, out in zip(shared, second[3:]):
        assert out.token_ids == hf_greedy(ref, prompt, 10)
    assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
])
def test_rope_scaling_variants(model_root, rope):
    folder = build_model(model_root / rope["rope_type"], "llama", rope_scaling=rope)
    ours, ref = load_model(folder), hf_model(folder)
    ids = torch.randint(0, 300, (2, 200))
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_dense(ids), ref(ids).logits, atol=1e-4, rtol=0)


def test_attention_bias_and_untied_qwen2(model_root):
    folder = build_model(model_root / "qwen2b", "qwen2", tie_word_embeddings=False)
    ours, ref = load_model(folder), hf_model(folder)
    ids = torch.randint(0, 300, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_dense(ids), ref(ids).logits, atol=1e-4, rtol=0)
