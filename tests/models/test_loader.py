"""Broken checkpoints fail with a message that names the file and the problem."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from leapfrog.models.loader import CheckpointError, load_model


@pytest.fixture
def ckpt(llama_dir, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(llama_dir, folder)
    return folder


def test_unsupported_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json.*GPT2LMHeadModel"):
        load_model(ckpt)


@pytest.mark.parametrize("patch, message", [
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh' is not supported"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps must be a number between 0 and 1"),
    ({"hidden_size": "64"}, "hidden_size must be a positive integer, not '64'"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, not 'false'"),
    ({"attention_bias": "no"}, "attention_bias must be true or false"),
])
def test_config_values_the_decoder_would_misread_are_refused(ckpt, patch, message):
    """These loaded before (a GELU model decoded with SiLU, wrong text and no error) or failed
    only inside a request's step."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(patch)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=f"config\\.json: {message}"):
        load_model(ckpt)


def test_missing_config_and_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load_model(ckpt)


def test_truncated_weights(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_model(ckpt)


def test_shape_mismatch_names_tensor(ckpt):
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"down_proj\.weight.*shape mismatch"):
        load_model(ckpt)


def test_missing_tensor_is_reported(ckpt):
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing.*layers\.1\.self_attn\.qkv_proj"):
        load_model(ckpt)


def test_sharded_index_and_missing_shard(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, ckpt / fname, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_model(ckpt)                                   # sharded loads fine
    assert model.lm_head.weight.shape[0] == 384
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: weight shard missing"):
        load_model(ckpt)
    for broken in ([], {"weight_map": ["a"]}, {"weight_map": {"x": 5}}):     # JSON, but not an index
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(broken))
        with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
            load_model(ckpt)


def test_a_config_that_is_not_an_object_is_named(ckpt):
    (ckpt / "config.json").write_text("[]")
    with pytest.raises(CheckpointError, match=r"config\.json: must hold a JSON object"):
        load_model(ckpt)


def test_sha256sums_manifest_is_enforced(ckpt):
    lines = []
    for f in sorted(ckpt.iterdir()):
        lines.append(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}")
    (ckpt / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    load_model(ckpt)                                           # intact: loads
    cfg = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(cfg.replace('"vocab_size"', ' "vocab_size"'))
    with pytest.raises(CheckpointError, match=r"config\.json: SHA256 mismatch"):
        load_model(ckpt)


@pytest.mark.parametrize("meta, message", [
    ({"default_method": 5}, "default_method must be a method's name, not 5"),
    ({"drafters": "drafters/dspark"}, "drafters must be an object of method -> folder or model name"),
    ({"drafters": {"dspark": 3}}, "drafters must be an object"),
    ({"method_options": [1]}, "method_options must be an object, not \\[1\\]"),
    ({"method_options": {"ar": "fast"}}, "method_options.ar must be an object"),
    ({"coupled_positions": 7}, "coupled_positions must be a token"),
])
def test_leapfrog_json_of_the_wrong_shape_is_refused_naming_it(ckpt, meta, message):
    """These were ignored (a list of method options failed with an AttributeError)."""
    from leapfrog.models.loader import model_meta
    (ckpt / "leapfrog.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=f"leapfrog\\.json: {message}"):
        model_meta(ckpt)


def test_a_default_method_that_is_not_one_is_refused(ckpt):
    from leapfrog.methods import default_method
    (ckpt / "leapfrog.json").write_text(json.dumps({"default_method": "dspakr", "future_key": 1}))
    with pytest.raises(CheckpointError, match="default_method 'dspakr' is not a method"):
        default_method(str(ckpt))        # it fell back to ar without a word
    (ckpt / "leapfrog.json").write_text(json.dumps({"default_method": "ar", "future_key": 1}))
    assert default_method(str(ckpt)) == "ar"     # keys it does not know stay allowed


def test_a_folder_method_option_that_is_wrong_names_the_file(ckpt):
    from leapfrog import LLM
    (ckpt / "leapfrog.json").write_text(json.dumps({"method_options": {"ar": {"gamma": 4}}}))
    with pytest.raises(ValueError, match="unknown option.*gamma.*leapfrog.json"):
        LLM(str(ckpt))
