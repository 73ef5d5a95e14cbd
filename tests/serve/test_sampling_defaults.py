"""A checkpoint's generation_config.json sets the sampling defaults of requests that leave them
out (vLLM's `--generation-config auto`): `couplets` is greedy unless asked otherwise, `stories`
samples at 0.7 / top-p 0.9. Oracle: a request without the fields equals one that spells the
model's defaults out; explicit request fields and the server's --temperature still win."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

from test_server_common import ServerThread

from leapfrog.serve.app import request_defaults
from leapfrog.serve.config import ServerConfig
from leapfrog.serve.openai_api import Limits, sampling_params
from leapfrog.serve.protocol import CompletionRequest
from leapfrog.sampling_params import model_sampling_defaults


def write_generation_config(folder, **cfg):
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **cfg}))


def test_generation_config_becomes_sampling_defaults(tmp_path):
    assert model_sampling_defaults(tmp_path) == {}                       # no file
    write_generation_config(tmp_path, do_sample=True, temperature=0.7, top_p=0.9, top_k=40)
    assert model_sampling_defaults(tmp_path) == {"temperature": 0.7, "top_p": 0.9, "top_k": 40}
    write_generation_config(tmp_path, do_sample=False, max_new_tokens=64, top_p=0.5, repetition_penalty=1.1)
    assert model_sampling_defaults(tmp_path) == {"temperature": 0.0, "repetition_penalty": 1.1}
    write_generation_config(tmp_path, top_p=2.0)
    with pytest.raises(ValueError, match=r"generation_config\.json: top_p=2\.0: must be in \(0, 1\]"):
        model_sampling_defaults(tmp_path)
    write_generation_config(tmp_path, temperature="hot")
    with pytest.raises(ValueError, match=r"generation_config\.json: temperature='hot': expected a number"):
        model_sampling_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"generation_config\.json: not valid JSON"):
        model_sampling_defaults(tmp_path)


def test_shipped_models_defaults():
    assert model_sampling_defaults("checkpoints/couplets") == {"temperature": 0.0}
    assert model_sampling_defaults("checkpoints/stories") == {"temperature": 0.7, "top_p": 0.9}


def test_request_fields_beat_server_flag_beats_model(tmp_path):
    write_generation_config(tmp_path, do_sample=True, temperature=0.7, top_p=0.9)
    assert request_defaults(ServerConfig(model=str(tmp_path))) == {"temperature": 0.7, "top_p": 0.9}
    assert request_defaults(ServerConfig(model=str(tmp_path), default_temperature=0.2))["temperature"] == 0.2
    (tmp_path / "generation_config.json").unlink()
    assert request_defaults(ServerConfig(model=str(tmp_path))) == {"temperature": 1.0}
    (tmp_path / "generation_config.json").write_text("[1, 2]")   # malformed: ignored, server serves
    assert request_defaults(ServerConfig(model=str(tmp_path))) == {"temperature": 1.0}

    limits = Limits({"m"}, 256, 100, 16, {"temperature": 0.7, "top_p": 0.9}, 4)
    p = sampling_params(CompletionRequest(prompt="x"), limits, 3, None)
    assert (p.temperature, p.top_p, p.top_k) == (0.7, 0.9, 0)
    p = sampling_params(CompletionRequest(prompt="x", temperature=0, top_p=0.5), limits, 3, None)
    assert (p.temperature, p.top_p) == (0.0, 0.5)


@pytest.fixture(scope="module")
def greedy_server(llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("greedy") / "model"
    shutil.copytree(llama_dir, folder)
    write_generation_config(folder, do_sample=False)
    s = ServerThread(folder).start()
    yield s
    s.stop()


def test_server_without_temperature_decodes_as_the_model_asks(greedy_server):
    url = greedy_server.url + "/v1/completions"
    for prompt in ("Once upon a time", "The cat liked to"):
        plain = httpx.post(url, json={"prompt": prompt, "max_tokens": 12}).json()["choices"][0]["text"]
        greedy = httpx.post(url, json={"prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
        assert plain == greedy["choices"][0]["text"]
    # An explicit temperature still samples: seeded draws differ from the greedy text.
    sampled = {httpx.post(url, json={"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.5,
                                     "seed": s}).json()["choices"][0]["text"] for s in range(4)}
    assert sampled != {plain}


def test_generate_cli_takes_the_models_defaults(llama_dir, tmp_path, capsys):
    from leapfrog.generate import main
    folder = tmp_path / "model"
    shutil.copytree(llama_dir, folder)
    write_generation_config(folder, do_sample=False)
    args = [str(folder.parent / "model"), "--max-tokens", "10", "--num-threads", "1"]
    assert main(["Once upon a time", "--model", *args]) == 0
    plain = capsys.readouterr().out
    assert main(["Once upon a time", "--model", *args, "--temperature", "0"]) == 0
    assert capsys.readouterr().out == plain


def test_generate_cli_names_a_broken_file_once(tmp_path, capsys):
    """A broken GGUF file is the loader's one error, not also a warning about sampling defaults."""
    from leapfrog.generate import main
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF but not really")
    assert main(["hi", "--model", str(broken)]) != 0
    err = capsys.readouterr().err
    assert "broken.gguf" in err and "sampling defaults" not in err and err.count("broken.gguf") == 1
