"""`leapfrog bench --suite speculative` end to end on the tiny Llama with tiny random drafters in
the published layouts: every contender's output equals ar's (greedy, lossless), and drafter
folders given with --drafters replace the shipped ones."""
from __future__ import annotations

import json

import pytest
from test_bench_peers import fake_cpp  # noqa: F401  (fixture)
from test_speculative import write_drafter

from leapfrog.bench import cli as bench

pytestmark = pytest.mark.usefixtures("one_thread")


def test_suite_end_to_end_with_chosen_drafters(llama_dir, tmp_path, capsys, fake_cpp):
    dflash = write_drafter(tmp_path / "d" / "dflash", llama_dir)
    dspark = write_drafter(tmp_path / "d" / "dspark", llama_dir, "dspark", num_layers=2, block_size=4)
    out = tmp_path / "res"
    rc = bench.main(["--suite", "speculative", "--model", str(llama_dir), "--drafters", str(dflash), str(dspark),
                     "--num-prompts", "2", "--new-tokens", "8", "--concurrency", "1", "2", "--repeats", "2",
                     "--threads", "1", "--ignore-eos", "--out", str(out),
                     "--llama-cpp-dir", str(fake_cpp), "--gguf", str(tmp_path / "m.gguf")])
    assert rc == 0
    res = json.loads((out / "speculative.json").read_text())
    assert res["ignore_eos"] is True           # so every request decodes exactly 8 tokens
    # llama.cpp's row comes last, in a clean environment (the fake is slow otherwise), and every
    # row carries its ratio to it
    peer = res["latency"].pop()
    assert peer["kind"] == "llama.cpp" and peer["tokens_per_s"] == 5000.0
    assert "-n 8" in peer["command"] and peer["speedup"] == pytest.approx(5000.0 / res["latency"][0]["tokens_per_s"])
    rows = {r["method"]: r for r in res["latency"]}
    sched = f"{dspark}, confidence-scheduled"      # the DSpark drafter has a confidence head
    assert list(rows) == ["ar", str(dflash), str(dspark), sched]
    assert [rows[k]["kind"] for k in rows] == ["ar", "dflash", "dspark", "dspark"]
    for r in res["latency"]:
        assert r["vs_llama_cpp"] == pytest.approx(r["tokens_per_s"] / 5000.0)
        assert r["identical_to_ar"] == "2/2" and r["output_tokens"] == 2 * 8
    for name in (str(dflash), str(dspark), sched):
        # Confidence scheduling may decide that drafting does not pay here (no τ then).
        assert (rows[name]["tau"] or 1) >= 1 and rows[name]["tokens_per_forward"] >= 1
        assert rows[name]["tau"] is not None or name == sched
        assert rows[name]["draft_model"] == name.removesuffix(", confidence-scheduled")
        assert rows[name]["drafter_layers"] in (1, 2)
    assert res["throughput_drafter"] == str(dspark)        # the only DSpark drafter given
    assert {r["concurrency"] for r in res["throughput"]} == {1, 2}
    for r in res["throughput"]:     # each level: ar = 1 by construction, every engine's rounds kept
        assert len(r["runs_tokens_per_s"]) == 2
        assert r["vs_ar"] == 1.0 if r["method"] == "ar" else r["vs_ar"] > 0
    assert sum("control" in r["method"] for r in res["throughput"]) == 2
    printed = capsys.readouterr().out
    assert "| ar |" in printed and "| llama.cpp (f16 GGUF, ar) |" in printed and "vs llama.cpp |" in printed


def test_a_drafter_folder_without_config_is_a_clear_error(llama_dir, tmp_path):
    from leapfrog.bench.speculative import latency_contenders
    with pytest.raises(FileNotFoundError, match="no config.json"):
        latency_contenders(llama_dir, None, [str(tmp_path)])


def test_drafters_may_be_named_as_variants_of_the_model(llama_dir, tmp_path):
    """--drafters NAME finds <model>/drafters/NAME (a built model's cache path need not be typed)."""
    import shutil

    from leapfrog.bench.speculative import latency_contenders
    from test_speculative import write_drafter
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    write_drafter(model / "drafters" / "mine", llama_dir, "dspark", num_layers=1, block_size=4)
    labels = [c.label for c in latency_contenders(model, None, ["mine"])]
    assert labels == ["ar", "mine", "mine, confidence-scheduled"]


def test_several_gammas_give_a_fixed_row_each_and_one_scheduled_row(llama_dir, tmp_path):
    """--gamma 2 3: a fixed row per γ, and the confidence-scheduled row over the whole block
    (the scheduler's choice set against the sweep); one γ still applies to every row."""
    import shutil

    from leapfrog.bench.speculative import latency_contenders
    from test_speculative import write_drafter
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    write_drafter(model / "drafters" / "mine", llama_dir, "dspark", num_layers=1, block_size=4)
    rows = latency_contenders(model, [2, 3], ["mine"])
    assert [c.label for c in rows] == ["ar", "mine, γ=2", "mine, γ=3", "mine, confidence-scheduled"]
    assert [c.options.get("num_speculative_tokens") for c in rows] == [None, 2, 3, None]
    one = latency_contenders(model, [2], ["mine"])
    assert [c.options.get("num_speculative_tokens") for c in one] == [None, 2, 2]
    # The verify-all rows say so: a model folder's defaults (leapfrog.json) must not schedule them.
    assert [c.options.get("verify") for c in rows] == [None, "fixed", "fixed", "confidence"]


def test_draft_models_add_a_row_per_gamma_and_decode_as_ar(llama_dir):
    """--draft-models: the `draft` method with each small AR model (here the target itself, so
    every draft is accepted), one row per γ and a confidence-scheduled one, in the latency
    table, with the output checked against `ar`."""
    from leapfrog import LLM
    from leapfrog.bench.speculative import latency_contenders, run_latency
    rows = latency_contenders(llama_dir, [2, 4], [], [str(llama_dir)])
    assert [(c.label, c.method, c.options) for c in rows[1:]] == [
        (f"draft model {llama_dir}, γ={g}", "draft",
         {"draft_model": str(llama_dir), "verify": "fixed", "num_speculative_tokens": g}) for g in (2, 4)] + [(f"draft model {llama_dir}, confidence-scheduled", "draft",
                             {"draft_model": str(llama_dir), "verify": "confidence", "num_speculative_tokens": 4})]
    prompts = [LLM(str(llama_dir)).tokenizer.encode(t) for t in ("Once upon a time", "The cat")]
    got = run_latency(llama_dir, prompts, 12, 3, drafters=[], ignore_eos=True, draft_models=[str(llama_dir)])
    assert [r["method"] for r in got] == ["ar", f"draft model {llama_dir}",
                                          f"draft model {llama_dir}, confidence-scheduled"]
    assert got[1]["identical_to_ar"] == "2/2" and got[1]["gamma"] == 3 and got[1]["tau"] > 3
    assert got[2]["identical_to_ar"] == "2/2" and got[2]["gamma"] == 3


def test_bfloat16_runs_every_row_in_it_and_adds_a_float32_ar_row(llama_dir, bf16_products):
    """--matmul-precision bfloat16: `ar` (the baseline) and the methods run with bfloat16
    products, drafting stays lossless against that `ar`, and a float32 `ar` row is added."""
    from leapfrog import LLM
    from leapfrog.bench.speculative import run_latency
    prompts = [LLM(str(llama_dir)).tokenizer.encode(t) for t in ("Once upon a time", "The cat")]
    got = run_latency(llama_dir, prompts, 12, 3, drafters=[], ignore_eos=True, draft_models=[str(llama_dir)],
                      engine_options={"matmul_precision": "bfloat16"})
    assert [(r["method"], r["matmul_precision"]) for r in got] == [
        ("ar", "bfloat16"), ("ar, float32 products", "float32"), (f"draft model {llama_dir}", "bfloat16"),
        (f"draft model {llama_dir}, confidence-scheduled", "bfloat16")]
    assert got[2]["identical_to_ar"] == got[3]["identical_to_ar"] == "2/2" and got[2]["tau"] > 3



def test_ngram_rows_and_prompt_sets(llama_dir, tmp_path):
    """--ngram adds prompt-lookup rows (verify all, scheduled), --prompts a table per set (open:
    chat requests through the model's template or its plain fallback), each row's output `ar`'s."""
    out = tmp_path / "res"
    rc = bench.main(["--suite", "speculative", "--model", str(llama_dir), "--ngram", "--prediction", "--prompts",
                     "stories", "open", "--num-prompts", "2", "--new-tokens", "8", "--concurrency", "1",
                     "--repeats", "1", "--threads", "1", "--ignore-eos", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "speculative.json").read_text())
    assert res["prompt_sets"] == ["stories", "open"]
    for name in ("stories", "open"):
        rows = [r for r in res["latency"] if r["prompts"] == name]
        assert [r["method"] for r in rows] == ["ar", "ngram, verify all", "ngram, confidence-scheduled",
                                               "ngram, confidence-scheduled, prediction = `ar`'s reply"]
        assert all(r["identical_to_ar"] == "2/2" for r in rows) and rows[0]["speedup"] == 1.0
        # decode: the 7 tokens after each prompt's first, over the time after it
        assert rows[0]["decode_speedup"] == 1.0 and all(r["decode_tokens_per_s"] > r["tokens_per_s"] for r in rows)
    assert any(r["method"] == "ngram, confidence-scheduled" for r in res["throughput"])
    assert "| open | ngram, verify all |" in (out / "speculative.md").read_text()
