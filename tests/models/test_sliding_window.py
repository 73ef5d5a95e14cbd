"""Sliding-window attention in Hugging Face folders (Mistral; Qwen2/3 with use_sliding_window):
greedy text token for token against transformers, with prompt and output longer than the window,
through chunked prefill and the paged decode path."""
from __future__ import annotations

import pytest
import torch
import transformers

from conftest import build_model
from leapfrog import LLM, SamplingParams
from leapfrog.models.llama import sliding_window

WINDOW = 12
PROMPT = list(range(10, 50))        # 40 tokens: past the window at prefill already


@pytest.mark.parametrize("family,overrides", [
    ("mistral", dict(sliding_window=WINDOW)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
])
def test_windowed_layers_decode_as_transformers(tmp_path, family, overrides):
    folder = build_model(tmp_path, family, **overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0, len(PROMPT):].tolist()
    llm = LLM(str(folder), block_size=4, max_num_batched_tokens=16)      # prefill in chunks, paged KV
    got = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].token_ids
    assert list(got) == want
    windows = [layer.self_attn.attn.window for layer in llm.engine.model.model.layers]
    assert windows == ([WINDOW, WINDOW] if family == "mistral" else [0, WINDOW])


def test_which_layers_slide():
    base = dict(sliding_window=8, max_position_embeddings=64)
    assert sliding_window({**base, "model_type": "llama"}, 0) == 0                       # transformers' Llama has none
    assert sliding_window({**base, "model_type": "qwen2"}, 3) == 0                       # not without use_sliding_window
    assert sliding_window({**base, "model_type": "qwen3", "use_sliding_window": True, "max_window_layers": 2}, 1) == 0
    assert sliding_window({**base, "model_type": "qwen3", "use_sliding_window": True, "max_window_layers": 2}, 2) == 8
    assert sliding_window({**base, "model_type": "qwen2", "layer_types": ["full_attention", "sliding_attention"]}, 1) == 8
    assert sliding_window({**base, "model_type": "mistral", "sliding_window": 64}, 0) == 0   # as long as the context
