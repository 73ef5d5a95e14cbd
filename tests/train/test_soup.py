"""Weight soups (leapfrog.train.soup): the written folder's weights are the weighted mean of the
ingredients', it loads in transformers with a valid manifest, and folders that cannot be averaged
are refused with the file and the mismatch named, leaving the output untouched."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import build_model

from leapfrog.train.export import verify_sha256sums
from leapfrog.train.soup import main, mix, write_soup


@pytest.fixture
def pair(tmp_path) -> tuple[Path, Path]:
    """Two folders of one tiny Llama architecture with different weights."""
    a = build_model(tmp_path / "a", "llama")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    w = load_file(str(b / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in w.items()},
              str(b / "model.safetensors"), metadata={"format": "pt"})
    return a, b


def test_soup_is_the_weighted_mean_and_loads_in_transformers(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    a, b = pair
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    out = tmp_path / "soup"
    write_soup([a, b], [0.25, 0.75], out, measure=False)
    ws = load_file(str(out / "model.safetensors"))
    assert set(ws) == set(wb)
    for name in wb:
        want = 0.25 * wa[name].float() + 0.75 * wb[name].float()
        assert torch.allclose(ws[name].float(), want, atol=1e-6), name
        assert not torch.equal(ws[name], wb[name])
    assert verify_sha256sums(out) == []
    assert (out / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    ids = torch.tensor([[1, 5, 9, 14]])
    soup = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).eval()
    with torch.no_grad():   # the soup's own logits, not the base's
        assert not torch.allclose(soup(ids).logits, ref(ids).logits)
    # All weight on one ingredient gives its weights back exactly.
    write_soup([a, b], [1.0, 0.0], out, measure=False)
    assert all(torch.equal(v, wa[k]) for k, v in load_file(str(out / "model.safetensors")).items())


def test_soup_may_overwrite_an_ingredient(pair):
    a, b = pair
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    write_soup([a, b], [0.5, 0.5], b, measure=False)
    ws = load_file(str(b / "model.safetensors"))
    assert all(torch.allclose(ws[k], (wa[k] + wb[k]) / 2, atol=1e-6) for k in wb)
    assert verify_sha256sums(b) == []


def test_mismatched_folders_are_refused_naming_the_file(pair, tmp_path, capsys):
    a, b = pair
    other = build_model(tmp_path / "wide", "llama", hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match=r"wide/llama/config\.json: hidden_size is 32"):
        mix([other, b], [0.5, 0.5])
    (tmp_path / "bad").mkdir()
    shutil.copy(b / "config.json", tmp_path / "bad" / "config.json")
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"bad/model\.safetensors: cannot read safetensors"):
        mix([tmp_path / "bad", b], [0.5, 0.5])
    with pytest.raises(ValueError, match="sum to 1"):
        mix([a, b], [0.5, 0.6])
    out = tmp_path / "out"
    assert main([str(other), str(b), "--out", str(out), "--no-measure"]) == 2
    assert "hidden_size is 32" in capsys.readouterr().err
    assert not out.exists()
