"""The shipped checkpoints: they load unchanged in leapfrog and transformers, agree, and the
default model answers with no arguments."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
import transformers

from leapfrog.config import CHECKPOINT_DIRS
from leapfrog.loader import load_model
from leapfrog.tokenizer import Tokenizer

BUILTIN = [p for p in sorted(CHECKPOINT_DIRS[0].iterdir()) if (p / "config.json").is_file()] \
    if CHECKPOINT_DIRS[0].is_dir() else []
TEXTS = {"stories": "Once upon a time, a little girl named Lily found a red ball.",
         "couplets": "春回大地万象新"}


@pytest.mark.parametrize("folder", BUILTIN, ids=lambda p: p.name)
def test_builtin_logits_and_tokens_match_transformers(folder):
    text = TEXTS.get(folder.name, "Hello")
    ours_tok = Tokenizer.from_folder(folder)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = ours_tok.encode(text)
    assert ids == hf_tok(text).input_ids
    ours = load_model(folder)                                  # verifies SHA256SUMS too
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_dense(x), ref(x).logits, atol=1e-4, rtol=0)
    assert (folder / "README.md").is_file() and (folder / "SHA256SUMS").is_file()


@pytest.mark.skipif(not any(p.name == "couplets" for p in BUILTIN), reason="couplets not trained yet")
@pytest.mark.parametrize("prompt", ["春回大地万象新", "关键词：春 福\n"])
def test_couplets_tokenizer_ends_a_raw_prompt_with_sep(prompt):
    """The couplets tokenizer marks the end of a prompt with <sep> as it marks the start with <s>,
    so a client sending the raw 上联 hands the model <s>上联<sep>: leapfrog and transformers alike."""
    folder = CHECKPOINT_DIRS[0] / "couplets"
    ours = Tokenizer.from_folder(folder)
    sep = ours.token_to_id("<sep>")
    ids = ours.encode(prompt)
    assert ids[0] == ours.bos_token_id and ids[-1] == sep
    assert ids == [ours.bos_token_id, *ours.encode(prompt, add_special_tokens=False), sep]
    assert ids[1:].count(ours.bos_token_id) == 0 and ids.count(sep) == 1
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf_tok(prompt).input_ids == ids
    assert hf_tok.decode(ids, skip_special_tokens=True) == ours.decode(ids) == prompt


@pytest.mark.skipif(not any(p.name == "stories" for p in BUILTIN), reason="stories not trained yet")
def test_generate_with_no_model_argument_tells_a_story():
    proc = subprocess.run([sys.executable, "-m", "leapfrog", "generate", "--max-tokens", "40",
                           "--temperature", "0", "Once upon a time"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    words = re.findall(r"[A-Za-z']+", proc.stdout)
    assert len(words) >= 15                                    # English words, not byte soup
    common = {"the", "a", "and", "was", "to", "she", "he", "they", "it", "her", "his"}
    assert sum(w.lower() in common for w in words) >= 3


@pytest.mark.skipif(not any(p.name == "stories" for p in BUILTIN), reason="stories not trained yet")
def test_offline_text_equals_streamed_text_with_sentencepiece():
    from leapfrog import LLM, SamplingParams
    llm = LLM("stories")
    params = SamplingParams(max_tokens=24, temperature=0)
    offline = llm.generate(["Once upon a time, there was"], params)[0].text
    engine = llm.engine
    engine.add_request("Once upon a time, there was", params, request_id="streamed")
    streamed = ""
    while engine.has_unfinished():
        streamed += "".join(o.delta_text for o in engine.step())
    assert streamed == offline and offline.startswith(" ")   # the first word keeps its space
