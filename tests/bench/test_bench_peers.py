"""The peers suite: peers run in a clean environment, the random sized model, the whole suite."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from leapfrog.bench import llama_cpp
from leapfrog.bench.cli import main as bench_main
from leapfrog.bench.random_model import parse_size, random_llama, shape_for, weight_bytes_per_token

FAKE_BENCH = """#!/usr/bin/env python3
import json, os, sys
# llama-bench's JSON output; fast only when no OpenMP or leapfrog variable leaked in
leaked = sorted(k for k in os.environ if k.startswith(("OMP_", "GOMP_", "KMP_", "LEAPFROG_")))
print(json.dumps([{"avg_ts": 1.0 if leaked else 5000.0, "stddev_ts": 0.0, "argv": sys.argv[1:], "leaked": leaked}]))
"""


@pytest.fixture
def fake_cpp(tmp_path) -> Path:
    exe = tmp_path / "cpp" / "build" / "bin" / "llama-bench"
    exe.parent.mkdir(parents=True)
    exe.write_text(FAKE_BENCH)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return tmp_path / "cpp"


def test_peers_never_inherit_openmp_or_leapfrog_settings(fake_cpp, monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")     # as the `leapfrog` command sets it
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("LEAPFROG_PORT", "9")
    exe = llama_cpp.find_binary("llama-bench", str(fake_cpp))
    r = llama_cpp.llama_bench(exe, Path("m.gguf"), 16, 2, 3)
    assert r["decode_tokens_per_s"] == 5000.0
    assert {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LEAPFROG_PORT"} <= set(r["env_dropped"])
    assert "-p 0 -n 16 -t 2 -r 3" in r["command"]


def test_sizes_and_shapes():
    assert parse_size("150m") == 150_000_000 and parse_size("1.5b") == 1_500_000_000
    with pytest.raises(ValueError, match="--size"):
        parse_size("big")
    from leapfrog.models.info import param_report
    cfg = shape_for(150_000_000, 4096)
    assert abs(param_report(cfg).total - 150e6) / 150e6 < 0.05


def test_random_model_loads_everywhere_and_counts_its_bytes(tmp_path, llama_dir):
    import torch
    import transformers

    from leapfrog import LLM, SamplingParams
    folder = random_llama("12m", llama_dir, tmp_path)
    assert random_llama("12m", llama_dir, tmp_path) == folder                  # reused
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    params = {n: p for n, p in hf.named_parameters()}
    embed = params["model.embed_tokens.weight"]
    read = sum(p.numel() for p in params.values()) - embed.numel() + embed.shape[1]
    assert weight_bytes_per_token(folder, 2) == 2 * read
    assert next(iter(params.values())).dtype == torch.float16
    out = LLM(str(folder)).generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_peers_suite_end_to_end(llama_dir, fake_cpp, tmp_path):
    out = tmp_path / "results"
    rc = bench_main(["--suite", "peers", "--model", str(llama_dir), "--new-tokens", "6", "--concurrency", "1", "2",
                     "--repeats", "1", "--threads", "1", "--llama-cpp-dir", str(fake_cpp), "--gguf",
                     str(tmp_path / "given.gguf"), "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "peers.json").read_text())
    engines = {r["engine"]: r for r in result["single"]}
    assert set(engines) == {"leapfrog", "transformers", "llama.cpp f16"}       # no converter: no f32
    assert engines["llama.cpp f16"]["decode_tokens_per_s"] == 5000.0          # ran clean
    lf = engines["leapfrog"]
    assert lf["weight_gb_per_s"] == pytest.approx(lf["weight_bytes_per_token"] * lf["decode_tokens_per_s"] / 1e9)
    assert result["read_bandwidth_gb_per_s"] > 0 and len(result["load_average"]) == 2
    assert result["matmul_precision"] == "float32"
    assert [r["concurrency"] for r in result["rows"]] == [1, 2]
    assert "GB/s of weights" in (out / "peers.md").read_text() and (out / "peers.png").is_file()


def test_depths_decode_after_cached_positions_against_llama_bench_d(llama_dir, fake_cpp, tmp_path, monkeypatch):
    """--depths N: one request decodes after a prompt of N tokens, and llama-bench runs with
    `-d N`; the table gives each depth's rates and ratio."""
    seen = []
    real = llama_cpp.llama_bench
    monkeypatch.setattr(llama_cpp, "llama_bench", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    out = tmp_path / "results"
    rc = bench_main(["--suite", "peers", "--model", str(llama_dir), "--new-tokens", "4", "--concurrency", "1",
                     "--repeats", "1", "--threads", "1", "--no-transformers", "--depths", "40", "90",
                     "--llama-cpp-dir", str(fake_cpp), "--gguf", str(tmp_path / "given.gguf"), "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "peers.json").read_text())
    assert [r["depth"] for r in result["depths"]] == [40, 90]
    for r in result["depths"]:
        assert r["leapfrog"] > 0 and r["peers"]["llama.cpp f16"] == 5000.0
        assert r["ratios"]["llama.cpp f16"] == pytest.approx(r["leapfrog"] / 5000.0)
    assert sorted(c["command"].rsplit(" -o json", 1)[1] for c in seen) == ["", " -d 40", " -d 90"]
    assert "| cached positions |" in (out / "peers.md").read_text()
    assert {r["engine"] for r in result["single"]} == {"leapfrog", "llama.cpp f16"}


def test_prefill_against_llama_bench_prompt_processing(llama_dir, fake_cpp, tmp_path, monkeypatch):
    """--prefill N: leapfrog reads a fresh prompt of N tokens to its first token each round (no
    prefix-cache hit), llama-bench runs `-p N -n 0` in a clean environment; the table gives each
    length's rates and ratio."""
    from leapfrog.bench import peers
    seen, timed = [], []
    real, real_run = llama_cpp.llama_bench_prompt, peers.leapfrog_prompt_run
    monkeypatch.setattr(llama_cpp, "llama_bench_prompt", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])

    def spy(llm, n, seed):
        before = llm.engine.block_manager.num_prefix_hits
        r = real_run(llm, n, seed)
        timed.append((n, seed, llm.engine.block_manager.num_prefix_hits - before))
        return r
    monkeypatch.setattr(peers, "leapfrog_prompt_run", spy)
    out = tmp_path / "results"
    rc = bench_main(["--suite", "peers", "--model", str(llama_dir), "--new-tokens", "4", "--concurrency", "1",
                     "--repeats", "2", "--threads", "1", "--no-transformers", "--prefill", "48", "96",
                     "--llama-cpp-dir", str(fake_cpp), "--gguf", str(tmp_path / "given.gguf"), "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "peers.json").read_text())
    assert [r["prompt_tokens"] for r in result["prefill"]] == [48, 96]
    for r in result["prefill"]:
        assert r["leapfrog"] > 0 and r["peers"]["llama.cpp f16"] == 5000.0
        assert r["ratios"]["llama.cpp f16"] == pytest.approx(r["leapfrog"] / 5000.0)
    assert sorted(c["command"].split(" -m ", 1)[1].split(" ", 1)[1] for c in seen) == sorted(
        [f"-p {n} -n 0 -t 1 -r 3 -o json" for n in (48, 96)] * 2)
    assert len({seed for _, seed, _ in timed}) == 4                 # a new prompt every time
    assert [hits for *_, hits in timed] == [0, 0, 0, 0]             # and never a prefix-cache hit
    assert "| prompt tokens |" in (out / "peers.md").read_text()


def test_bfloat16_products_add_llama_cpps_bfloat16_gguf(fake_cpp, tmp_path, monkeypatch):
    """With leapfrog's bfloat16 products, llama.cpp also decodes a bfloat16 GGUF (the same kind
    of dot product); with float32 products only float16 and float32."""
    import argparse

    from leapfrog.bench import peers
    asked = []
    monkeypatch.setattr(peers.llama_cpp, "make_gguf",
                        lambda folder, cpp, out, kind: asked.append(kind) or tmp_path / f"m-{kind}.gguf")
    args = argparse.Namespace(llama_cpp_dir=str(fake_cpp), out=str(tmp_path), gguf=None)
    assert set(peers.llama_cpp_peers(args, tmp_path, "bfloat16")) == {"f16", "f32", "bf16"}
    assert set(peers.llama_cpp_peers(args, tmp_path)) == {"f16", "f32"}
    assert asked == ["f16", "f32", "bf16", "f16", "f32"]



@pytest.mark.parametrize("argv, message", [
    (["--threads", "0"], "--threads 0: must be at least 1"),
    (["--concurrency", "1", "0"], "--concurrency 0: must be at least 1"),
    (["--suite", "speculative", "--num-prompts", "-2"], "--num-prompts -2: must be at least 1"),
    (["--suite", "diffusion", "--thresholds", "2"], "--thresholds 2.0: a confidence"),
    (["--suite", "soak", "--duration", "-5"], "--duration -5.0: must be a positive"),
    (["--llama-cpp-dir", "/no/such/llama.cpp"], "--llama-cpp-dir /no/such/llama.cpp: not found"),
])
def test_bad_counts_are_usage_errors(argv, message, capsys, tmp_path):
    # these once reached torch.set_num_threads or a loop and ended in a traceback
    with pytest.raises(SystemExit) as e:
        bench_main(argv + ["--out", str(tmp_path)])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_model_is_an_error_not_a_traceback(capsys, tmp_path):
    rc = bench_main(["--model", str(tmp_path / "nothing"), "--repeats", "1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "nothing" in err
    assert not (tmp_path / "out").exists()
