"""A checkpoint trained with coupled positions (leapfrog.json "coupled_positions": a token
after whose first occurrence the rotary positions restart) decodes with those positions in the
engine. Oracle: transformers' forward given the same position ids, greedy, token by token."""
from __future__ import annotations

import json
import shutil

import torch

from leapfrog import LLM, SamplingParams
from leapfrog.layers.rotary import coupled_positions


def _coupled_copy(llama_dir, tmp_path):
    from leapfrog.tokenizer import Tokenizer
    folder = tmp_path / "coupled"
    shutil.copytree(llama_dir, folder)
    tok = Tokenizer.from_folder(folder)
    anchor_text = ","
    anchor = tok.token_to_id(anchor_text)
    assert anchor is not None
    (folder / "leapfrog.json").write_text(json.dumps({"coupled_positions": anchor_text}))
    return folder, tok, anchor


@torch.no_grad()
def _reference(folder, ids: list[int], bos: int, anchor: int, n: int) -> list[int]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    seq = list(ids)
    for _ in range(n):
        x = torch.tensor([seq])
        logits = model(input_ids=x, position_ids=coupled_positions(x, bos, anchor)).logits
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(ids):]


def test_engine_decodes_with_the_declared_positions(llama_dir, tmp_path):
    folder, tok, anchor = _coupled_copy(llama_dir, tmp_path)
    prompts = ["Once upon a time, there was", "The cat, the dog and the bird, all"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(str(folder))
    assert llm.engine.model.coupled_anchor == (tok.bos_token_id, anchor)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        assert anchor in ids
        assert out.token_ids == _reference(folder, ids, tok.bos_token_id, anchor, 12)
    # the same checkpoint without the declaration decodes differently (the positions matter)
    plain = LLM(str(llama_dir)).generate(prompts, params)
    assert [o.token_ids for o in plain] != [o.token_ids for o in outs]


def test_the_transformers_check_decodes_coupled_checkpoints_alike(llama_dir, tmp_path):
    """train.check (the README's numbers, scripts/couplets_lengths.py) uses transformers: for a
    coupled checkpoint it must give the engine's greedy tokens."""
    from leapfrog.train.check import generate, load
    folder, tok, anchor = _coupled_copy(llama_dir, tmp_path)
    prompts = ["Once upon a time, there was", "The cat, the dog and the bird, all"]
    model, hf_tok = load(str(folder))
    got = generate(model, hf_tok, prompts, do_sample=False, max_new_tokens=10)
    want = LLM(str(folder)).generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for g, w in zip(got, want):
        eos = hf_tok.eos_token_id
        cut = w.token_ids[:w.token_ids.index(eos) + 1] if eos in w.token_ids else w.token_ids
        assert g == cut


@torch.no_grad()
def test_the_scorer_forward_uses_the_declared_positions(llama_dir, tmp_path):
    """forward_dense scores `leapfrog eval`'s validation loss: transformers' logits at the
    coupled position ids."""
    from transformers import AutoModelForCausalLM

    from leapfrog.models.loader import load_model
    folder, tok, anchor = _coupled_copy(llama_dir, tmp_path)
    ids = torch.tensor([tok.encode("The cat, the dog and the bird, all ran home")])
    got = load_model(folder).forward_dense(ids)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = hf(input_ids=ids, position_ids=coupled_positions(ids, tok.bos_token_id, anchor)).logits
    assert torch.allclose(got, want, atol=1e-4)


def test_the_decode_loop_gives_the_layer_paths_tokens(llama_dir, tmp_path, monkeypatch):
    """The C++ decode loop (several steps per call) takes each row's anchor: one in the prompt,
    one produced inside the loop, and one never produced. Oracle: the layer-by-layer path and
    transformers at the coupled positions."""
    from leapfrog.engine import decode_loop
    from leapfrog.layers.cpu_kernels import cpu_kernels
    from leapfrog.tokenizer import Tokenizer
    if cpu_kernels() is None:
        return
    tok = Tokenizer.from_folder(llama_dir)
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    plain = LLM(str(llama_dir)).generate(["A big red ball"], params)[0].token_ids
    # anchor on the plain model's 4th greedy token: produced inside the loop, after which the
    # coupled decode departs from the plain one
    anchor = plain[3]
    assert anchor not in tok.encode("A big red ball") and anchor not in plain[:3]
    folder = tmp_path / "coupled-gen"
    shutil.copytree(llama_dir, folder)
    (folder / "leapfrog.json").write_text(json.dumps({"coupled_positions": tok.id_to_token(anchor)}))
    prompts = ["A big red ball", "Once upon a time, there was", "Zzz"]
    prompt_ids = [tok.encode(p) for p in prompts]
    prompt_ids[1] = prompt_ids[1][:1] + [anchor] + prompt_ids[1][1:]      # an anchor in the prompt
    loop_llm = LLM(str(folder), num_scheduler_steps=5)
    loop_out = [o.token_ids for o in loop_llm.generate(prompt_ids, params)]
    assert loop_llm.engine.decode_loop.num_loop_steps > 0
    monkeypatch.setattr(decode_loop, "ENABLED", False)
    layer_out = [o.token_ids for o in LLM(str(folder)).generate(prompt_ids, params)]
    assert loop_out == layer_out
    assert loop_out[0][:4] == plain[:4] and loop_out[0] != plain
    for ids, got in zip(prompt_ids, loop_out):
        assert got == _reference(folder, ids, tok.bos_token_id, anchor, 14)


def test_a_prompt_ending_in_repeated_anchors_keeps_one(llama_dir, tmp_path):
    """Positions restart after the first anchor, so a prompt that ends in two (a client that
    appends the marker the tokenizer appends too) would shift every answer token by one: it is
    decoded as the prompt with one, token for token. An anchor inside the prompt stays."""
    folder, tok, anchor = _coupled_copy(llama_dir, tmp_path)
    ids = tok.encode("Once upon a time, there was")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(str(folder))
    one, two, three = llm.generate([ids + [anchor], ids + [anchor] * 2, ids + [anchor] * 3], params)
    assert one.prompt_token_ids == two.prompt_token_ids == three.prompt_token_ids == ids + [anchor]
    assert one.token_ids == two.token_ids == three.token_ids
    assert one.token_ids == _reference(folder, ids + [anchor], tok.bos_token_id, anchor, 8)
    # without the declaration the prompt is the client's
    plain = LLM(str(llama_dir)).generate([ids + [anchor] * 2], params)[0]
    assert plain.prompt_token_ids == ids + [anchor] * 2
