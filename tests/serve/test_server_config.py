"""Server configuration: precedence flags > env > file > defaults, guide vocabulary, errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from leapfrog.serve.main import build_parser, main
from leapfrog.serve.config import ConfigError, build_config, flags_from_args

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def flags(*argv: str) -> dict:
    return flags_from_args(build_parser().parse_args(list(argv)))


def test_defaults():
    cfg = build_config({}, environ={})
    assert (cfg.model, cfg.host, cfg.port) == ("stories", "0.0.0.0", 8080)
    assert cfg.engine == {} and cfg.api_key == [] and cfg.model_id == "stories"


def test_precedence_flags_env_file_defaults(tmp_path):
    path = write(tmp_path, "c.yaml", "port: 1000\nmax_batch_size: 3\ndefault_temperature: 0.1\n")
    env = {"LEAPFROG_PORT": "2000", "LEAPFROG_MAX_BATCH_SIZE": "5"}
    cfg = build_config(flags("--config", path, "--port", "3000"), environ=env)
    assert cfg.port == 3000                          # flag beats env and file
    assert cfg.engine["max_batch_size"] == 5         # env beats file
    assert cfg.default_temperature == 0.1            # file beats default
    assert build_config(flags("--config", path), environ={}).port == 1000
    assert build_config({}, environ={"LEAPFROG_CONFIG": path}).port == 1000


def test_guide_vocabulary_in_file():
    cfg = build_config({"config": str(EXAMPLES / "serve-guide.yaml")}, environ={})
    assert cfg.engine == {"max_batch_size": 16, "max_model_len": 512, "dtype": "float32", "kv_cache_dtype": "float32"}
    assert cfg.default_temperature == 0.7
    cfg = build_config({"config": str(EXAMPLES / "serve-guide-env-style.yaml")}, environ={})
    assert cfg.engine == {"kv_cache_tokens": 8192, "max_batch_size": 16}
    assert (cfg.default_max_tokens, cfg.default_temperature) == (128, 0.7)


def test_deepspeed_style_parallel_keys(tmp_path):
    """The couplet guide's hybrid-parallel keys, nested as DeepSpeed writes them, map onto ours;
    an unknown key inside a section is still an error naming it; flags set the same fields."""
    cfg = build_config({"config": str(EXAMPLES / "serve-hybrid-parallel.json")}, environ={})
    assert cfg.engine == {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "max_batch_size": 8}
    bad = write(tmp_path, "bad.json", json.dumps({"pipeline": {"pipeline_parallel_size": 2, "stages": 4}}))
    with pytest.raises(ConfigError, match="unknown key 'pipeline.stages'"):
        build_config({"config": bad}, environ={})
    both = write(tmp_path, "both.json", json.dumps({"tensor_parallel": {"tp_size": 2}, "tensor_parallel_size": 4}))
    with pytest.raises(ConfigError, match="both set tensor_parallel_size"):
        build_config({"config": both}, environ={})
    assert build_config(flags("--pipeline-parallel-size", "2"), environ={}).engine == {"pipeline_parallel_size": 2}
    with pytest.raises(ConfigError, match="pipeline_parallel_size=0"):
        build_config(flags("--pipeline-parallel-size", "0"), environ={})


def test_the_kv_cache_size_in_tokens_or_bytes_follows_the_layers():
    """kv_cache_tokens and kv_cache_bytes say one thing two ways: the higher layer's wins whichever
    it names (flags > environment > file), and --kv-cache-tokens takes a size with its unit, as its
    help says."""
    env = {"LEAPFROG_KV_CACHE_TOKENS": "64"}
    assert build_config(flags("--kv-cache-bytes", "4096"), environ=env).engine == {"kv_cache_bytes": 4096}
    assert build_config(flags("--kv-cache-tokens", "2GiB"), environ={}).engine == {"kv_cache_bytes": 2 << 30}
    assert build_config(flags("--kv-cache-tokens", "4096"), environ={"CACHE_SIZE": "1GiB"}).engine == \
        {"kv_cache_tokens": 4096}
    with pytest.raises(ConfigError, match="kv_cache_tokens='1.5'"):
        build_config(flags("--kv-cache-tokens", "1.5"), environ={})


def test_guide_vocabulary_in_env():
    env = {"CACHE_SIZE": "512MiB", "MAX_TOKENS": "99", "BATCH_SIZE": "4", "TEMPERATURE": "0.5",
           "LEAPFROG_ENABLE_PREFIX_CACHING": "false", "LEAPFROG_API_KEY": "a, b",
           "LEAPFROG_CHECKPOINTS": "/elsewhere"}          # other parts' variables are left alone
    cfg = build_config({}, environ=env)
    assert cfg.engine == {"kv_cache_bytes": 512 * 2**20, "max_batch_size": 4, "enable_prefix_caching": False}
    assert (cfg.default_max_tokens, cfg.default_temperature, cfg.api_key) == (99, 0.5, ["a", "b"])
    assert build_config({}, environ={"CACHE_SIZE": "4096"}).engine == {"kv_cache_tokens": 4096}
    # the prefixed name wins over the bare guide name
    assert build_config({}, environ={"BATCH_SIZE": "4", "LEAPFROG_BATCH_SIZE": "6"}).engine["max_batch_size"] == 6


def test_example_files_load():
    for path in sorted(EXAMPLES.glob("serve*.*")):
        if "secure" in path.name:     # names certificate files that exist only in a deployment
            with pytest.raises(ConfigError, match="ssl_certfile.*file not found"):
                build_config({"config": str(path)}, environ={})
            continue
        build_config({"config": str(path)}, environ={})


@pytest.mark.parametrize("text,needle", [
    ("prot: 80\n", "unknown key 'prot' (did you mean 'port'?)"),
    ("port: eighty\n", "port='eighty': expected an integer"),
    ("max_batch_size: -1\n", "max_batch_size=-1"),
    ("dtype: float8\n", "dtype='float8'"),
    ("enable_prefix_caching: maybe\n", "enable_prefix_caching='maybe': expected true or false"),
    ("rate_limit: -2\n", "rate_limit=-2.0: must be >= 0"),
    ("BATCH_SIZE: 4\nmax_batch_size: 8\n", "both set max_batch_size"),
    ("CACHE_SIZE: 2XB\n", "unknown size unit 'XB'"),
    ("- just\n- a list\n", "expected a mapping"),
    ("method: dspak\n", "method='dspak': expected one of"),
    ("models: [stories, /somewhere/else/stories]\n", "two of them would be served as 'stories'"),
])
def test_bad_file_values_name_key_and_value(tmp_path, text, needle):
    path = write(tmp_path, "bad.yaml", text)
    with pytest.raises(ConfigError) as e:
        build_config({"config": path}, environ={})
    assert needle in str(e.value)


def test_a_config_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes("port: 8080\n".encode("utf-16"))
    with pytest.raises(ConfigError, match="c.yaml.*UTF-8"):
        build_config({"config": str(path)}, environ={})


def test_bad_env_and_json(tmp_path):
    with pytest.raises(ConfigError, match=r"environment: port='x8': expected an integer"):
        build_config({}, environ={"LEAPFROG_PORT": "x8"})
    path = write(tmp_path, "c.json", json.dumps({"port": "8080"}))     # a string where a number belongs
    with pytest.raises(ConfigError, match="port='8080'"):
        build_config({"config": path}, environ={})
    with pytest.raises(ConfigError, match="not found"):
        build_config({"config": str(tmp_path / "missing.yaml")}, environ={})


def test_method_options_merge(tmp_path):
    path = write(tmp_path, "c.yaml", "method_options: {a: 1, b: 2}\n")
    cfg = build_config(flags("--config", path, "--option", "b=3"), environ={})
    assert cfg.method_options == {"a": 1, "b": 3}
    assert cfg.engine_kwargs()["method"] == "ar"


def test_cli_reports_config_errors(tmp_path, capsys):
    path = write(tmp_path, "bad.yaml", "max_batch_sise: 4\n")
    assert main(["--config", path]) == 2
    err = capsys.readouterr().err
    assert "max_batch_sise" in err and "max_batch_size" in err
    with pytest.raises(SystemExit):
        main(["--port", "not-a-number"])


def test_cli_missing_model_fails_fast(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "no-such-model"), "--port", "0"]) == 2
    assert "no-such-model" in capsys.readouterr().err


def test_cli_names_a_broken_gguf_file_without_a_traceback(tmp_path, capsys):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    assert main(["--model", str(broken), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("leapfrog serve: ") and "broken.gguf: not a readable GGUF file" in err
    assert "Traceback" not in err


def test_cli_a_port_in_use_fails_before_the_models_load(capsys, monkeypatch):
    """A port another process holds is named at once (exit 2), not after every model has loaded."""
    import socket

    import leapfrog.serve.main as serve_main
    monkeypatch.setattr(serve_main, "create_app", lambda cfg: pytest.fail("the models were loaded"))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert main(["--model", "stories", "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "in use" in err


def test_cli_an_empty_model_name_is_refused(capsys):
    """`--model ""` once resolved to the current folder."""
    assert main(["--model", "", "--port", "0"]) == 2
    assert "the name is empty" in capsys.readouterr().err


def test_a_draft_model_for_a_method_that_reads_none_is_refused_before_binding(capsys, monkeypatch):
    import leapfrog.serve.main as serve_main
    monkeypatch.setattr(serve_main, "create_app", lambda cfg: pytest.fail("the models were loaded"))
    assert main(["--model", "stories", "--method", "ar", "--draft-model", "stories", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "draft_model='stories': method 'ar' reads no draft model (those that do: dflash, dspark, draft)" in err


def test_served_models_default_both_builtins_and_repeat_model():
    """No model named: `stories` (first, the default of requests naming none), `couplets` and `smollm2`;
    --model once: that model alone; --model repeated: those, the first taking the method."""
    cfg = build_config({}, environ={})
    from leapfrog.serve.config import default_served
    assert cfg.models == default_served() and default_served()[:2] == ["stories", "couplets"]
    assert [v.model_id for v in cfg.views()] == cfg.models
    assert build_config(flags("--model", "couplets"), environ={}).models == ["couplets"]
    cfg = build_config(flags("--model", "stories", "--model", "couplets", "--method", "dspark"), environ={})
    first, second = cfg.views()
    assert (first.model, first.method, second.model, second.method) == ("stories", "dspark", "couplets", None)
    assert build_config({}, environ={"LEAPFROG_MODELS": "couplets,stories"}).model == "couplets"
    with pytest.raises(ConfigError, match="served_model_name"):
        build_config(flags("--model", "a", "--model", "b", "--served-model-name", "x"), environ={})
    with pytest.raises(ConfigError, match="named twice"):
        build_config(flags("--model", "a", "--model", "a"), environ={})
