"""Sampling: penalties, temperature, top-k / top-p / min-p, and seeded draws.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import torch

from leapfrog.layers.cpu_kernels import cpu_kernels
from leapfrog.sequence import Sequence

_U64 = 1 << 64


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition penalty (Keskar et al. 2019) over prompt + output; presence and frequency
    penalties (OpenAI) over the output only, as vLLM does; then logit_bias, allowed_token_ids and
    bad_words; before `min_tokens` output tokens, the end-of-text and stop token ids are banned
    (vLLM's min_tokens); then the logits processors.
    In place, row i for seqs[i]. Diffusion steps score several positions with one request's rows:
    the ban then holds for the whole step."""
    for i, seq in enumerate(seqs):
        if seq.params.needs_penalties:
            penalize_drafted_rows(logits[i:i + 1], seq, [])
    return logits


def bad_words_after(history: list[int], bad_words_ids: list[list[int]]) -> list[int]:
    """The tokens that would complete one of the bad words after `history` (vLLM's bad_words:
    the last token of each word whose other tokens `history` ends with)."""
    return [w[-1] for w in bad_words_ids if len(w) == 1 or history[len(history) - len(w) + 1:] == w[:-1]]


def penalize_drafted_rows(logits: torch.Tensor, seq: Sequence, drafts: list[int]) -> torch.Tensor:
    """The penalties of apply_penalties for the rows of one request's verify step, in place: row
    j is the distribution after drafts[:j], so it is penalized as if those drafts had been
    committed (what `ar` would have seen there)."""
    p = seq.params
    rows, vocab = logits.shape
    dev = logits.device
    drafts = list(drafts[:rows - 1])
    # added[j, t]: how many times token t is among drafts[:j]
    added = torch.zeros(rows, vocab, dtype=logits.dtype, device=dev)
    for j, t in enumerate(drafts):
        if 0 <= t < vocab:
            added[j + 1:, t] += 1
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
        ids = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=dev)
        seen[ids[ids < vocab]] = True
        mask = seen.unsqueeze(0) | (added > 0)
        penalized = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits.copy_(torch.where(mask, penalized, logits))
    if p.presence_penalty or p.frequency_penalty:
        counts = added
        if seq.num_output_tokens:
            out = torch.tensor(seq.output_ids, device=dev, dtype=torch.long)
            counts = counts + torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=dev, dtype=torch.long)
        logits.index_add_(1, ids, torch.tensor(list(p.logit_bias.values()), device=dev, dtype=logits.dtype)
                          .expand(rows, -1).contiguous())
    if p.allowed_token_ids is not None:
        banned = torch.ones(vocab, dtype=torch.bool, device=dev)
        banned[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=dev)] = False
        logits.masked_fill_(banned, float("-inf"))
    ban = [t for t in (*seq.eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
    narrowed = seq.grammar is not None or p.allowed_token_ids is not None
    # Bans below can leave a narrowed row nothing: the end tokens min_tokens takes away, or, under
    # a constraint, bad_words and processors' -inf. The constraint (or allowed set) then wins.
    banning = (bool(ban) and seq.num_output_tokens < p.min_tokens) or (
        seq.grammar is not None and (bool(seq.bad_words_ids) or bool(p.logits_processors)))
    before_ban = logits.clone() if narrowed and banning else None
    for j in range(rows):
        if seq.bad_words_ids:
            banned_next = [t for t in bad_words_after(seq.output_ids + drafts[:j], seq.bad_words_ids) if 0 <= t < vocab]
            if banned_next:
                logits[j, banned_next] = float("-inf")
        if seq.num_output_tokens + j < p.min_tokens and ban:
            logits[j, ban] = float("-inf")
        if p.logits_processors:
            history = seq.output_ids + drafts[:j]
            for process in p.logits_processors:
                logits[j].copy_(process(history, logits[j]))
    if seq.grammar is not None:
        seq.grammar.mask_rows(logits, seq.output_ids, drafts)
    if before_ban is not None:      # a grammar or allowed set that the bans leave empty: it wins
        dead = torch.isneginf(logits).all(-1)
        if bool(dead.any()):
            if seq.grammar is not None:
                seq.grammar.mask_rows(before_ban, seq.output_ids, drafts)
            logits[dead] = before_ban[dead]
    return logits


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """logits [N, V] already divided by temperature; per-row top_k (0 = off), top_p, min_p."""
    neg_inf = torch.finfo(logits.dtype).min
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, logits.shape[-1]).clamp(max=logits.shape[-1])
        kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))
        logits = logits.masked_fill(logits < kth, neg_inf)
    if bool((top_p < 1).any()):
        probs_sorted, idx = logits.softmax(-1).sort(dim=-1, descending=True)
        before = probs_sorted.cumsum(-1) - probs_sorted        # mass strictly above each token
        drop_sorted = before > top_p.unsqueeze(-1)             # the top token always survives
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, neg_inf)
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        floor = min_p.unsqueeze(-1) * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, neg_inf)
    return logits


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed if seed < 1 << 64 else seed % (1 << 64))   # a request's seed + choice index
        return g

    def probs(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[int] | None = None) -> torch.Tensor:
        """Target distribution per row after penalties, temperature and filters (sampled rows;
        greedy rows become one-hot). Speculative verification compares against this; `drafts`:
        the rows are one request's verify step, row j after drafts[:j] (penalize_drafted_rows)."""
        if drafts is not None and seqs and seqs[0].params.needs_penalties:
            logits = penalize_drafted_rows(logits.clone(), seqs[0], drafts)
        else:
            logits = apply_penalties(logits.clone(), seqs)
        # greedy rows (temperature under GREEDY_BELOW_TEMPERATURE) become one-hot below; dividing
        # them by a tiny temperature would only overflow
        temps = torch.tensor([1.0 if s.params.greedy else s.params.temperature for s in seqs],
                             device=logits.device)
        logits = filter_logits(logits / temps.unsqueeze(-1), *self._filters(seqs, logits.device, logits.shape[-1]))
        probs = logits.softmax(-1)
        greedy = torch.tensor([s.params.greedy for s in seqs], device=logits.device)
        if bool(greedy.any()):
            onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
            probs = torch.where(greedy.unsqueeze(-1), onehot, probs)
        return probs

    def _filters(self, seqs: list[Sequence], device: torch.device, vocab: int) -> tuple[torch.Tensor, ...]:
        top_k = torch.tensor([min(max(s.params.top_k, 0), vocab) for s in seqs], device=device)
        top_p = torch.tensor([s.params.top_p for s in seqs], device=device)
        min_p = torch.tensor([s.params.min_p for s in seqs], device=device)
        return top_k, top_p, min_p

    def draw(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One token per row from `probs` [N, V], each row with its request's generator."""
        noise = torch.empty_like(probs)
        for i, seq in enumerate(seqs):
            noise[i].exponential_(generator=seq.generator or self.generator)
        return (probs / noise).argmax(-1)

    def sample_key(self, seq: Sequence) -> int:
        """The request's key for the CPU sampler (signed 64-bit): its seed, or a number drawn
        from this sampler's generator the first time an unseeded request samples."""
        if seq.sample_key is None:
            if seq.params.seed is not None:
                seq.sample_key = seq.params.seed % _U64
            else:
                seq.sample_key = int(torch.randint(0, (1 << 63) - 1, (1,), generator=self.generator))
        key = seq.sample_key
        return key - _U64 if key >= 1 << 63 else key

    def row_settings(self, seqs: list[Sequence], device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
        """Per row: temperature (0 for greedy), top_k, top_p, min_p, key and draw counter, as the
        C++ sampler takes them. A sequence listed twice draws twice."""
        uses: dict[int, int] = {}
        counters = []
        for s in seqs:
            k = uses.get(id(s), 0)
            counters.append(s.num_draws + k)
            uses[id(s)] = k + 1
        dev = device or self.device
        p = [s.params for s in seqs]
        return (torch.tensor([0.0 if x.greedy else x.temperature for x in p], dtype=torch.float32, device=dev),
                torch.tensor([x.top_k for x in p], dtype=torch.long, device=dev),
                torch.tensor([x.top_p for x in p], dtype=torch.float32, device=dev),
                torch.tensor([x.min_p for x in p], dtype=torch.float32, device=dev),
                torch.tensor([self.sample_key(s) for s in seqs], dtype=torch.long, device=dev),
                torch.tensor(counters, dtype=torch.long, device=dev))

    def verify_picked(self, logits: torch.Tensor, seq: Sequence, drafts: list[int]) -> list[int] | None:
        """Verification of drafts that were picked rather than sampled (their q is one-hot:
        n-gram lookups, predictions, argmax drafters) for a sampled request: row j is sampled as
        `ar` samples that output position (the request's key and draw counter, the C++ sampler),
        and drafts are kept while they equal those draws. Accepting d with probability p(d) and
        otherwise drawing from p without d is the lossless rule for a one-hot q, so this is that
        rule with `ar`'s own noise: a seeded request writes what `ar` writes, whatever was
        drafted and whatever shares its steps. None where the C++ sampler does not run."""
        mod = cpu_kernels() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
        if mod is None:
            return None
        rows = logits.shape[0]
        if seq.params.needs_penalties:
            logits = penalize_drafted_rows(logits.clone(), seq, drafts)
        draws = mod.sample_rows(logits, *self.row_settings([seq] * rows)).tolist()
        n = 0
        while n < min(len(drafts), rows - 1) and drafts[n] == draws[n]:
            n += 1
        seq.num_draws += n + 1
        return drafts[:n] + [draws[n]]

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict] | None]:
        """logits [N, V] fp32, one row per sequence -> token ids (and logprobs if asked)."""
        mod = cpu_kernels() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
        if mod is not None:
            probs_in = apply_penalties(logits.clone(), seqs) if any(s.params.needs_penalties for s in seqs) else logits
            token_list = mod.sample_rows(probs_in, *self.row_settings(seqs)).tolist()
            for s in seqs:
                s.num_draws += 1
        elif all(s.params.greedy and not s.params.needs_penalties for s in seqs):
            token_list = logits.argmax(-1).tolist()
        else:
            probs = self.probs(logits, seqs)
            tokens = self.draw(probs, seqs)
            greedy = torch.tensor([s.params.greedy for s in seqs], device=logits.device)
            token_list = torch.where(greedy, probs.argmax(-1), tokens).tolist()
        if all(s.params.logprobs is None for s in seqs):
            return token_list, None
        return token_list, token_logprobs(logits, token_list, seqs)


def token_logprobs(logits: torch.Tensor, tokens: list[int], seqs: list[Sequence]) -> list[dict]:
    """Log-probabilities of the model's raw distribution (before sampling transforms)."""
    lp = logits.log_softmax(-1)
    out = []
    for i, (t, seq) in enumerate(zip(tokens, seqs)):
        n = seq.params.logprobs
        if n is None:
            out.append({})
            continue
        entry = {"token_id": t, "logprob": lp[i, t].item(), "top": []}
        if n:
            vals, ids = lp[i].topk(n)
            entry["top"] = list(zip(ids.tolist(), vals.tolist()))
        out.append(entry)
    return out
