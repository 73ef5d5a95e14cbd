"""transformers as a peer, in a process of its own: `python hf_peer.py` reads a JSON job on stdin
({"model", "threads", "new_tokens", "pad_id", "single": [ids], "batches": [[[ids], ...], ...]})
and prints the timings as JSON.

Run by path, not as `-m leapfrog...`: importing the leapfrog package would set its OpenMP
settings in this process, and importing transformers into the benchmark's own process slowed
leapfrog's decoding there. Each engine is measured in an environment of its own.
"""
import json
import sys
import time

sys.path.pop(0)       # this file's folder holds modules named like stdlib and third-party ones


def generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """Left-padded static batch through `generate`; returns wall seconds."""
    # deferred: torch loads only when the peer runs (this file is run by path)
    import torch
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t0


def main() -> None:
    # deferred: torch and transformers load only when the peer runs (this file is run by path)
    import torch
    import transformers
    job = json.loads(sys.stdin.read())
    torch.set_num_threads(job["threads"])
    model = transformers.AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32).eval()
    n, pad, single = job["new_tokens"], job["pad_id"], job["single"]
    generate(model, [single], 4, pad)                                  # warm up
    prefill = min(generate(model, [single], 1, pad) for _ in range(2))
    total = generate(model, [single], n, pad)
    out = {"single": {"wall_s": total, "tokens_per_s": n / total,
                      "decode_tokens_per_s": (n - 1) / max(1e-9, total - prefill)},
           "batches": [generate(model, b, n, pad) for b in job["batches"]],
           "transformers": transformers.__version__}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
