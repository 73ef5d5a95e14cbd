"""generation_config.json `suppress_tokens`: ids a model must never generate (transformers'
key, honoured by its generate). leapfrog puts them in the LM head's bias at load time, so every
decoding path obeys; transformers' generate on the same folder is the oracle."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from leapfrog import LLM, SamplingParams
from leapfrog.models.loader import CheckpointError, load_model

PROMPTS = [[1, 5, 9], [1] + list(range(20, 57)), [1, 7, 7, 7, 7, 7], [1, 300]]


def with_suppressed(src, dst, ids) -> str:
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**cfg, "suppress_tokens": ids}))
    return str(dst)


def hf_greedy(folder, prompt: list[int], n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("path", ["layers", "loop"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])           # untied and tied LM heads
def test_greedy_skips_suppressed_tokens_like_transformers(family_dirs, family, path, tmp_path, monkeypatch):
    from leapfrog.engine import decode_loop
    monkeypatch.setattr(decode_loop, "ENABLED", path == "loop")
    plain = LLM(str(family_dirs[family]))
    free = [o.token_ids for o in plain.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0,
                                                                       ignore_eos=True))]
    banned = sorted({ids[0] for ids in free} | {ids[3] for ids in free})   # tokens it would pick
    folder = with_suppressed(family_dirs[family], tmp_path / family, banned)
    llm = LLM(folder)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert (llm.engine.decode_loop.num_calls > 0) == (path == "loop")
    for prompt, out, before in zip(PROMPTS, outs, free):
        assert not set(out.token_ids) & set(banned)
        assert out.token_ids != before
        assert out.token_ids == hf_greedy(folder, prompt, 8)


def test_sampling_never_draws_a_suppressed_token(family_dirs, tmp_path):
    banned = list(range(3, 384, 2))                    # half the vocabulary
    llm = LLM(with_suppressed(family_dirs["llama"], tmp_path / "m", banned))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=1.5, seed=0, ignore_eos=True,
                                                logprobs=3))
    drawn = {t for o in outs for t in o.token_ids}
    assert len(drawn) > 20 and not drawn & set(banned)
    for o in outs:                                     # nor offered as an alternative
        assert all(not {t for t, _ in entry["top"]} & set(banned) for entry in o.logprobs)


@pytest.mark.parametrize("value", [[384], ["4"], 4, [True]])
def test_bad_suppress_tokens_names_the_file(family_dirs, tmp_path, value):
    folder = with_suppressed(family_dirs["llama"], tmp_path / "m", value)
    with pytest.raises(CheckpointError, match=r"generation_config\.json: suppress_tokens="):
        load_model(folder)


def test_scoring_keeps_the_raw_distribution(family_dirs, tmp_path):
    """leapfrog eval's scorer loads with suppress=False: a text's every token is scored, and the
    couplets prompt marker it bans from generation is one of them."""
    folder = with_suppressed(family_dirs["llama"], tmp_path / "m", [5, 9])
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        a, b, c = (m.forward_dense(ids) for m in (load_model(family_dirs["llama"]),
                                                  load_model(folder, suppress=False), load_model(folder)))
    assert torch.equal(a, b)
    assert (c[..., [5, 9]] < -1e8).all() and torch.equal(c[..., :5], a[..., :5])
