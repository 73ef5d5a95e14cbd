"""Tensor and pipeline parallelism on CPU with gloo: a model split over 2 tensor-parallel ranks,
2 pipeline stages, or 2 x 2, gives the logits of the whole model (float32, 1e-5) and the same
greedy and seeded tokens, for Llama (untied head), Qwen2 (q/k/v bias, tied embeddings), Qwen3
(per-head q/k norm) and Qwen3-MoE / Qwen2-MoE models (experts split across tensor-parallel ranks);
what is not split yet is refused by name; a follower rank that dies stops the engine with an error, never a hang."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from leapfrog import LLM, SamplingParams
from leapfrog.layers import parallel as tp
from test_server_common import free_port

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[1, 5, 9, 30, 44], [1, 100, 200, 7, 7, 7, 8, 9, 10, 11, 12], [1, 5, 9, 30, 44, 61]]


def _rank_logits(rank: int, size: int, port: int, folder: str, ids: torch.Tensor, out: str,
                 stages: int = 1) -> None:
    torch.set_num_threads(1)
    tp.init(rank, size, f"tcp://127.0.0.1:{port}", pipeline_size=stages)
    from leapfrog.models.loader import load_model
    model = load_model(folder)
    local_params = sum(p.numel() for p in model.parameters())
    logits = model.forward_dense(ids)
    if rank == 0:
        torch.save({"logits": logits, "params": local_params}, out)
    tp.shutdown()


def _split_logits(folder, tp_size: int, stages: int, tmp_path) -> tuple[torch.nn.Module, dict]:
    """The whole model, and rank 0's logits and parameter count over tp_size x stages ranks;
    the logits are checked against the whole model's (float32, 1e-5)."""
    from leapfrog.models.loader import load_model
    ids = torch.tensor([PROMPTS[1]])
    whole = load_model(folder)
    want = whole.forward_dense(ids)
    out = tmp_path / "logits.pt"
    size = tp_size * stages
    mp.start_processes(_rank_logits, args=(size, free_port(), str(folder), ids, str(out), stages), nprocs=size,
                       join=True, start_method="spawn")
    got = torch.load(out)
    assert got["logits"].shape == want.shape
    torch.testing.assert_close(got["logits"], want, rtol=1e-5, atol=1e-5)
    return whole, got


@pytest.mark.parametrize("family,tp_size,stages", [("llama", 2, 1), ("qwen2", 2, 1), ("qwen3", 2, 1),
                                                    ("llama", 1, 2), ("qwen2", 1, 2), ("llama", 2, 2)])
def test_split_model_gives_the_whole_models_logits(family, tp_size, stages, family_dirs, tmp_path):
    folder = family_dirs[family]
    whole, got = _split_logits(folder, tp_size, stages, tmp_path)
    total = sum(p.numel() for p in whole.parameters())
    layers = total - sum(p.numel() for n, p in whole.named_parameters() if not n.startswith("model.layers."))
    if stages == 1:        # each rank holds its share: about half, plus the norms every rank keeps
        assert got["params"] < 0.6 * total
    else:                  # rank 0 holds its stage's layers (its shard of them) and the vocabulary tables
        assert got["params"] <= total - layers + layers / (tp_size * stages) * 1.01


@pytest.mark.parametrize("family,tp_size,stages", [("llama", 2, 1), ("qwen2", 2, 1), ("llama", 1, 2),
                                                    ("qwen2", 2, 2)])
def test_generate_over_ranks_gives_the_same_tokens(family, tp_size, stages, family_dirs):
    folder = str(family_dirs[family])
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    biased = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias={7: 4.0, 9: -100.0})
    params = [GREEDY, seeded, biased]
    scored = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
    whole_llm = LLM(folder, block_size=4)
    want = [o.token_ids for o in whole_llm.generate(PROMPTS, params)]
    whole = whole_llm.generate(PROMPTS, scored)
    llm = LLM(folder, block_size=4, tensor_parallel_size=tp_size, pipeline_parallel_size=stages)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
        again = llm.generate(PROMPTS[:1], GREEDY)[0]               # the prefix cache, split too
        assert again.token_ids == want[0] and again.metrics.num_cached_prompt_tokens == 4
        split = llm.generate(PROMPTS, scored)                     # the prompt rows' logits, gathered
        for a, b in zip(split, whole):
            assert [e["token_id"] for e in a.prompt_logprobs[1:]] == [e["token_id"] for e in b.prompt_logprobs[1:]]
            assert [e["logprob"] for e in a.prompt_logprobs[1:]] == pytest.approx(
                [e["logprob"] for e in b.prompt_logprobs[1:]], abs=1e-4)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from test_moe import build_moe
    root = tmp_path_factory.mktemp("moe")
    # 3 layers (stages of 2 and 1), 8 experts (4 per tensor-parallel rank); qwen2_moe adds a
    # gated shared expert, split as a dense MLP is
    return {f: build_moe(root, f) for f in ("qwen3_moe", "qwen2_moe")}


@pytest.mark.parametrize("family,tp_size,stages", [("qwen3_moe", 1, 2), ("qwen3_moe", 2, 1), ("qwen2_moe", 2, 1)])
def test_mixture_of_experts_over_ranks(family, tp_size, stages, moe_dirs, tmp_path):
    """Pipeline stages keep their experts whole; tensor-parallel ranks hold half the experts
    each (expert parallelism) and half the shared expert's columns. The logits and the greedy
    tokens are the whole model's; a batch of three runs through the stages in micro-batches."""
    folder = moe_dirs[family]
    whole, got = _split_logits(folder, tp_size, stages, tmp_path)
    if tp_size == 2:
        experts = sum(p.numel() for n, p in whole.named_parameters() if ".experts." in n)
        assert got["params"] < sum(p.numel() for p in whole.parameters()) - 0.45 * experts
    tokens = [o.token_ids for o in LLM(str(folder), block_size=4).generate(PROMPTS, GREEDY)]
    llm = LLM(str(folder), block_size=4, tensor_parallel_size=tp_size, pipeline_parallel_size=stages)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == tokens
        if stages > 1:
            stats = llm.engine.parallel_stats()
            assert len(stats) == 2 and all(s["num_steps"] > 0 and 0 < s["busy_seconds"] <= s["seconds"]
                                           for s in stats)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def method_models(llama_dir, tmp_path_factory):
    from test_diffusion import MASK, diffusion_folder
    from test_mask_stream import two_stream_folder
    from test_speculative import write_drafter
    root = tmp_path_factory.mktemp("methods")
    return {"drafter": write_drafter(root / "dspark", llama_dir, "dspark", num_layers=2, block_size=4),
            "diffusion": diffusion_folder(llama_dir, root / "diffusion", block_size=4, mask_token_id=MASK,
                                          diffusion_logit_shift=True),
            "two-stream": two_stream_folder(llama_dir, root / "two-stream", noise=0.05)}


@pytest.mark.parametrize("tp_size,stages", [(2, 1), (1, 2)])
def test_speculative_and_diffusion_over_ranks(tp_size, stages, llama_dir, method_models):
    """DSpark with confidence-scheduled verification (decided from measured time: every rank
    reads rank 0's clock and prices steps by rank 0's profile; the drafter runs whole on every
    rank) gives ar's greedy tokens, and block diffusion gives one process's, over tensor-parallel
    ranks and over pipeline stages; a two-stream diffusion model over tensor-parallel ranks."""
    ranks = dict(tensor_parallel_size=tp_size, pipeline_parallel_size=stages, block_size=4)
    cases = [(llama_dir, "dspark", {"draft_model": str(method_models["drafter"]), "verify": "confidence"}),
             (method_models["diffusion"], "diffusion", {"threshold": 0.5})]
    if stages == 1:
        cases.append((method_models["two-stream"], "diffusion", {"threshold": 0.6}))
    for folder, method, opts in cases:
        want = [o.token_ids for o in LLM(str(folder), method="ar" if method == "dspark" else method,
                                         block_size=4, **({} if method == "dspark" else opts)).generate(PROMPTS, GREEDY)]
        llm = LLM(str(folder), method=method, **ranks, **opts)
        try:
            assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want, method
            if method == "dspark":
                assert llm.engine.method.stats()["num_drafted_tokens"] > 0
        finally:
            llm.shutdown()


def _shm_rank(rank: int, port: int, out: str, die: bool) -> None:
    import json
    torch.set_num_threads(1)
    tp.init(rank, 2, f"tcp://127.0.0.1:{port}")
    result = {"shm": tp._STATE.shm is not None}
    x = torch.arange(12, dtype=torch.float32).view(3, 4) * (rank + 1)
    tp.all_reduce(x)                                      # through shared memory
    result["sum"] = x.tolist()
    big = torch.full((tp._ShmGroup.SLOT + 1,), float(rank + 1))
    tp.all_reduce(big)                                    # too big for a slot: gloo
    result["big"] = float(big[-1])
    result["gather"] = tp.all_gather_last(torch.full((2, 2), float(rank))).tolist()
    if die and rank == 1:
        os._exit(0)                                       # gone without a word
    if die:
        t0 = time.time()
        try:
            tp.all_reduce(torch.ones(4))
        except RuntimeError as exc:
            result["error"], result["after_s"] = str(exc), time.time() - t0
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    if not die:
        tp.shutdown()


def _full_shm_rank(rank: int, port: int, out: str) -> None:
    import errno
    import json

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    os.posix_fallocate = no_room                          # /dev/shm is full
    torch.set_num_threads(1)
    tp.init(rank, 2, f"tcp://127.0.0.1:{port}")
    x = torch.full((2, 3), float(rank + 1))
    tp.all_reduce(x)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"shm": tp._STATE.shm is not None, "sum": x.tolist()}, f)
    tp.shutdown()


def test_a_full_dev_shm_means_gloo(tmp_path):
    """No room for the buffers in /dev/shm (a container's small default): both ranks agree to
    use gloo, the sums are right, and no file is left behind."""
    import json
    out = tmp_path / "full.json"
    mp.start_processes(_full_shm_rank, args=(free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    r = json.loads(out.read_text())
    assert r == {"shm": False, "sum": [[3.0, 3.0, 3.0]] * 2}
    assert not any(f.name.startswith("leapfrog-") for f in Path("/dev/shm").iterdir())


def test_shared_memory_collectives_between_ranks_of_one_machine(tmp_path):
    """Ranks on one machine sum and gather through shared memory (gloo for what does not fit a
    slot), and a rank waiting for a peer that died gets an error within seconds, not a hang."""
    import json
    out = tmp_path / "shm.json"
    mp.start_processes(_shm_rank, args=(free_port(), str(out), False), nprocs=2, join=True, start_method="spawn")
    r = json.loads(out.read_text())
    assert r["shm"] and r["sum"] == (torch.arange(12.).view(3, 4) * 3).tolist() and r["big"] == 3.0
    assert r["gather"] == [[0.0, 0.0, 1.0, 1.0]] * 2
    out.unlink()
    ctx = mp.start_processes(_shm_rank, args=(free_port(), str(out), True), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.time() + 60
    while not out.exists() and time.time() < deadline:
        time.sleep(0.2)
    for p in ctx.processes:
        p.join(5)
        if p.is_alive():
            p.kill()
    r = json.loads(out.read_text())
    assert "shared-memory collective: rank 1" in r["error"] and r["after_s"] < 5
    assert not any(f.name.startswith("leapfrog-") for f in Path("/dev/shm").iterdir())


def test_generate_command_over_pipeline_stages(llama_dir):
    """`leapfrog generate --pipeline-parallel-size 2` starts its ranks and prints one process's text."""
    import subprocess
    import sys
    args = [sys.executable, "-m", "leapfrog", "generate", "--model", str(llama_dir), "--max-tokens", "10",
            "--temperature", "0", "--ignore-eos", "Once upon a time"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    want = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    got = subprocess.run(args + ["--pipeline-parallel-size", "2"], capture_output=True, text=True, timeout=120, env=env)
    assert want.returncode == 0 and got.returncode == 0, got.stderr
    assert got.stdout == want.stdout and want.stdout.strip()


def test_micro_batches_split_the_batch_by_query_tokens():
    from leapfrog.methods.base import Batch
    from leapfrog.engine.runner import micro_batches

    class S:
        def __init__(self, n):
            self.num_query = n
    sizes = lambda parts: [[s.num_query for s in p.seqs] for p in parts]  # noqa: E731
    assert sizes(micro_batches(Batch([S(1)] * 4), 2)) == [[1, 1], [1, 1]]
    assert sizes(micro_batches(Batch([S(30), S(1), S(1), S(1)]), 2)) == [[30], [1, 1, 1]]
    assert sizes(micro_batches(Batch([S(1), S(1), S(30)]), 2)) == [[1, 1], [30]]
    assert sizes(micro_batches(Batch([S(1)] * 3), 4)) == [[1], [1], [1]]
    assert sizes(micro_batches(Batch([S(5)]), 2)) == [[5]]


def test_what_is_not_split_yet_is_refused_by_name(llama_dir):
    with pytest.raises(ValueError, match="support the ar, dflash, dspark, diffusion method"):
        LLM(str(llama_dir), method="couplet-magic", tensor_parallel_size=2)
    from leapfrog.engine.llm_engine import LLMEngine
    with pytest.raises(ValueError, match="start the ranks"):
        LLMEngine(str(llama_dir), tensor_parallel_size=2)       # not through LLM: no group to join
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(llama_dir), tensor_parallel_size=0)


def test_a_dead_follower_stops_the_engine_with_an_error(llama_dir):
    from leapfrog.engine.distributed import RankDied
    llm = LLM(str(llama_dir), tensor_parallel_size=2)
    try:
        assert llm.generate(PROMPTS[:1], GREEDY)[0].token_ids
        follower = llm.engine.followers[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(10)
        t0 = time.time()
        with pytest.raises(RankDied, match="rank\\(s\\) 1 died"):
            llm.generate(PROMPTS[:1], GREEDY)
        assert time.time() - t0 < 5
    finally:
        llm.shutdown()


TORCHRUN_SCRIPT = """
import json, sys
from leapfrog import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2)      # rank 1 follows inside this call, then exits
out = llm.generate([[1, 5, 9, 30, 44]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
print("TOKENS", json.dumps(out[0].token_ids))
llm.shutdown()
"""


INTERRUPTED = """
import sys
from leapfrog import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2)
    print("built", flush=True)
    while True:
        llm.generate([[1, 5, 9, 30, 44]] * 8, SamplingParams(max_tokens=64, temperature=0.8, ignore_eos=True))
"""


def test_ctrl_c_in_a_step_over_ranks_stops_the_program(llama_dir, tmp_path):
    """Ctrl-C lands in a step's collectives on rank 0: the ranks are out of step, so the stop
    that used to be broadcast to the follower waited forever, both ranks spinning. Rank 0 now
    stops its followers without a collective and the program ends."""
    import subprocess
    import sys
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED)
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, str(script), str(llama_dir)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        try:
            assert proc.stdout.readline().strip() == "built"
            time.sleep(1.5)
            followers = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == proc.pid
                         and b"spawn_main" in _cmdline(int(p))]
            assert followers
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
            time.sleep(0.5)
            assert not [p for p in followers if os.path.exists(f"/proc/{p}") and b"spawn_main" in _cmdline(p)]
        finally:
            if proc.poll() is None:
                proc.kill()


def test_a_size_the_model_cannot_be_split_by_is_one_error_without_tracebacks(llama_dir):
    """4 ranks over 2 KV heads: every rank fails alike; rank 0 says why, the followers one line
    each (they printed whole tracebacks first, before rank 0's message)."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "leapfrog", "generate", "--model", str(llama_dir),
                           "--tensor-parallel-size", "4", "--max-tokens", "2", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_a_follower_that_dies_before_joining_is_named_at_once(llama_dir, tmp_path):
    """A script without `if __name__ == "__main__":`: its spawned follower dies while starting,
    and rank 0 waited in the rendezvous for its whole timeout (300 s) before failing."""
    import subprocess
    import sys
    script = tmp_path / "unguarded.py"
    script.write_text(f"from leapfrog import LLM\nLLM({str(llama_dir)!r}, tensor_parallel_size=2)\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "before joining the group" in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 60


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_two_node_torchrun_on_loopback(llama_dir, tmp_path):
    """Two torchrun launchers, node ranks 0 and 1, one rendezvous on 127.0.0.1: rank 0 drives
    and prints, rank 1 follows and exits 0."""
    import json
    import shutil
    import subprocess
    import sys
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r),
                               "--master-addr", "127.0.0.1", "--master-port", str(port), str(script), str(llama_dir)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("TOKENS"))
    want = LLM(str(llama_dir)).generate([[1, 5, 9, 30, 44]], GREEDY)[0].token_ids
    assert json.loads(line.split(" ", 1)[1]) == want
    assert "TOKENS" not in outs[1]


def test_serve_under_torchrun_over_two_nodes_of_pipeline_stages(llama_dir, tmp_path):
    """One replica over two torchrun "nodes" on loopback, a pipeline stage each (what the
    multi-node StatefulSet in deploy/k8s runs): rank 0 serves HTTP with the whole model's greedy
    text, rank 1 follows; SIGTERM to rank 0's launcher stops both with exit code 0. A group of
    the wrong size is refused with a message."""
    import shutil
    import subprocess
    import sys
    import httpx
    from test_server_common import wait_ready
    body = {"prompt": [1, 5, 9, 30, 44], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    want = LLM(str(llama_dir)).generate([body["prompt"]], GREEDY)[0].text
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    master, port = free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def launch(node: int, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
                                 "--master-addr", "127.0.0.1", "--master-port", str(master), "-m", "leapfrog", "serve",
                                 "--model", str(llama_dir), "--host", "127.0.0.1", "--port", str(port),
                                 "--warmup-requests", "1", "--log-level", "warning", *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    procs = [launch(r, "--pipeline-parallel-size", "2") for r in (0, 1)]
    try:
        wait_ready(procs[0], f"http://127.0.0.1:{port}")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        worker = _children(procs[0].pid)          # rank 0 itself (torchrun answers SIGTERM with 1)
        assert len(worker) == 1
        os.kill(worker[0], signal.SIGTERM)
        assert [p.wait(60) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    master = free_port()
    wrong = [launch(r) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in wrong]
    assert all(p.returncode != 0 for p in wrong)
    assert "torchrun started 2 processes" in outs[0][1]


def _children(parent: int, marker: str = "") -> list[int]:
    """Processes whose parent is `parent` (and whose command line holds `marker`)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            cmd = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if ppid == parent and marker in cmd:
            out.append(int(entry))
    return out


def _spawned_children(parent: int) -> list[int]:
    """multiprocessing's spawned children of `parent` (the follower ranks, not its resource tracker)."""
    return _children(parent, "spawn_main")


def test_serve_over_two_ranks_and_recover_from_a_dead_rank(llama_dir, tmp_path):
    import subprocess
    import sys
    import httpx
    from test_server_common import wait_ready
    body = {"prompt": [1, 5, 9, 30, 44], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    want = LLM(str(llama_dir)).generate([body["prompt"]], GREEDY)[0].text
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "leapfrog", "serve", "--model", str(llama_dir), "--host", "127.0.0.1",
                             "--port", str(port), "--tensor-parallel-size", "2", "--warmup-requests", "1",
                             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        followers = _spawned_children(proc.pid)
        assert len(followers) == 1
        os.kill(followers[0], signal.SIGKILL)      # a rank dies: the engine is rebuilt, ranks included
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code in (500, 503), r.text
        deadline = time.time() + 60
        while httpx.get(url + "/ready").status_code != 200 and time.time() < deadline:
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        m = httpx.get(url + "/metrics").text
        assert 'leapfrog:engine_restarts_total{model_name="llama"} 1.0' in m
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
    text = (tmp_path / "serve.log").read_text()
    assert "died" in text


def test_parallel_benchmark_reports_equal_tokens_and_collective_cost(llama_dir, tmp_path):
    import json
    from leapfrog.bench.cli import main
    assert main(["--suite", "parallel", "--model", str(llama_dir), "--new-tokens", "8", "--concurrency", "1", "2",
                 "--repeats", "1", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "parallel.json").read_text())
    assert [(row["tp"], row["pp"], row["concurrency"]) for row in r["rows"]] == [
        (1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 1, 2), (1, 2, 1), (1, 2, 2)]
    assert all(row["same_tokens"] and row["tok_s"] > 0 for row in r["rows"])
    assert all(row["comm_per_step_ms"] > 0 for row in r["rows"] if (row["tp"], row["pp"]) != (1, 1))
    assert all(0 <= row["bubble"] < 1 for row in r["rows"] if row["pp"] == 2 and row["concurrency"] == 2)
    assert "pipeline bubble" in (tmp_path / "parallel.md").read_text()
