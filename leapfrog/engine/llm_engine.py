"""LLMEngine: add_request / step / abort over the scheduler, runner and decoding method."""
from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import logging
import math
from dataclasses import replace
from numbers import Integral

from typing import Any, Callable

import torch

from leapfrog.engine.block_manager import BlockManager
from leapfrog.engine.kv_tiers import HostKVTier, RedisKVTier
from leapfrog.config import EngineConfig, resolve_model
from leapfrog.layers import linear as linear_layers
from leapfrog.layers.linear import compact_cpu_weights
from leapfrog.layers.parallel import agree_min, gather_objects, pp_size, tp_size
from leapfrog.models.loader import load_model, model_engine_options, model_method_options, read_config
from leapfrog.methods import draft_model_check, method_class
from leapfrog.layers.attention import StepInterrupted
from leapfrog.layers.cpu_kernels import LoopCall
from leapfrog.methods.base import Batch, Method, MethodContext, ScheduledSeq, StepOutput
from leapfrog.engine.decode_loop import MultiStep
from leapfrog.engine.output_processor import EngineStats, OutputProcessor
from leapfrog.outputs import RequestOutput
from leapfrog.engine.runner import ModelRunner
from leapfrog.sample.grammar import compiler_for
from leapfrog.sample.sampler import Sampler
from leapfrog.sampling_params import ParamError, SamplingParams
from leapfrog.engine.scheduler import Scheduler, SchedulerConfig
from leapfrog.sequence import Sequence
from leapfrog.tokenizer import Tokenizer

log = logging.getLogger("leapfrog.engine.llm_engine")


def release_freed_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc): loading a GGUF file dequantizes
    and repacks tensors whose freed memory would otherwise stay resident. A no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def bad_words_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """vLLM's bad_words as token sequences: each word as written (leading spaces stripped) and
    after a space (how it reads after another word); every distinct sequence is kept."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out += [ids for ids in (plain, spaced) if ids and ids not in out]
    return out


class LLMEngine:
    def __init__(self, model: str, method: str = "ar", draft_model: str | None = None,
                 **options: object) -> None:
        self.model_path = resolve_model(model)
        # The model folder's engine defaults (leapfrog.json: its numerics), under the caller's own.
        self.config, method_options = EngineConfig.from_options({**model_engine_options(self.model_path), **options})
        for name, size in (("tensor_parallel_size", tp_size()), ("pipeline_parallel_size", pp_size())):
            if getattr(self.config, name) != size:
                raise ValueError(f"engine option {name}={getattr(self.config, name)}: this process is in a group "
                                 f"of {size}; start it through LLM, `leapfrog generate` or `leapfrog serve`, "
                                 "which start the ranks")
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        self.model_name = str(model)
        self.device = self.config.torch_device()
        self.dtype = self.config.torch_dtype(self.device)
        self.hf_config = read_config(self.model_path)
        self.tokenizer = Tokenizer.from_folder(self.model_path)
        if self.config.chat_template is not None:       # a broken one is named before the weights load
            self.tokenizer.use_chat_template(self.config.chat_template)
        self.model = load_model(self.model_path, self.device, self.dtype)
        self.max_model_len = self._max_model_len()
        self.sampler = Sampler(self.device, self.config.seed)
        draft_model_check(method, draft_model)
        ctx = MethodContext(self.model, self.model_path, self.tokenizer, self.sampler,
                            self.device, self.dtype, draft_model, self._paged_runner, self.timed_step)
        # The model folder's defaults for this method (leapfrog.json), under the caller's own.
        folder_options = model_method_options(self.model_path, method)
        try:
            self.method: Method = method_class(method)(ctx, **{**folder_options, **method_options})
        except ValueError as e:
            if folder_options:      # say where options the caller did not pass came from
                raise ValueError(f"{e} (the model folder's defaults for {method!r}, from "
                                 f"{self.model_path / 'leapfrog.json'}: {folder_options})") from None
            raise
        self.method_name = method
        missing = linear_layers.products_available(self.config.matmul_precision)
        if self.device.type == "cpu" and missing:
            # a model folder's default as much as a caller's: without the instructions the
            # products would run as scalar loops, many times slower than float32 ones
            log.warning("matmul_precision=%s needs the C++ kernels on a CPU with %s; using float32 products",
                        self.config.matmul_precision, missing)
            self.config = self.config.replace(matmul_precision="float32")
        if self.device.type == "cpu" and self.config.kv_torch_dtype(self.device) == torch.bfloat16:
            log.warning("kv_cache_dtype=bfloat16: the CPU kernels read float32 or float16 caches, so "
                        "attention runs through torch, several times slower; float16 halves the cache as well")
        if self.device.type == "cpu":   # float16 checkpoints: stream half the bytes, same results
            for module in [self.model, *self.method.modules()]:
                compact_cpu_weights(module, self.config.matmul_precision)
            release_freed_heap()
        # KV blocks hold whole attention blocks, so prefix-cache hits and rollbacks end on the
        # block-causal grid, where a block's KV no longer depends on tokens after it.
        if self.config.block_size % self.method.attn_block_size:
            self.config = self.config.replace(
                block_size=math.lcm(self.config.block_size, self.method.attn_block_size))
        step = self.method.max_step_tokens      # query tokens one decode step needs
        if step > self.config.max_num_batched_tokens:
            raise ValueError(f"engine option max_num_batched_tokens={self.config.max_num_batched_tokens}: "
                             f"method {method!r} feeds {step} query tokens per sequence and step")
        if not self.config.chunked_prefill and self.config.max_num_batched_tokens < self.max_model_len:
            # vLLM's rule: a prompt over the step budget would wait for a step that never comes
            raise ValueError(f"engine option max_num_batched_tokens={self.config.max_num_batched_tokens}: with "
                             f"chunked_prefill off a whole prompt is one step, so it must hold the context "
                             f"({self.max_model_len} tokens); raise it, lower max_model_len or chunk prefills")
        self.runner = ModelRunner(self.model, self._num_blocks(), self.config.block_size,
                                  self.device, self.config.kv_torch_dtype(self.device))
        self.runner.interruptible = max(tp_size(), pp_size()) == 1
        invariant_here = self.runner.cpu_decode_kernel and max(tp_size(), pp_size()) == 1
        if self.config.batch_invariant and not invariant_here:
            raise ValueError("engine option batch_invariant=True: needs the CPU kernels in a single process "
                             f"(here: device {self.device.type}, kernels "
                             f"{'built' if self.runner.cpu_decode_kernel else 'unavailable'}, "
                             f"{max(tp_size(), pp_size())} rank(s))")
        self.runner.one_group = invariant_here and self.config.batch_invariant is not False
        if (self.config.kv_spill_bytes or self.config.kv_remote_url) and max(tp_size(), pp_size()) > 1:
            # The second and third tiers decide by clock (TTL) and by what other processes
            # published: ranks could decide differently, and their schedules must not.
            raise ValueError("kv_spill_bytes / kv_remote_url: the prefix cache's second and third tiers are not "
                             "available with tensor or pipeline parallelism (the ranks' cache decisions must agree)")
        tier = None
        if self.config.kv_spill_bytes and self.config.enable_prefix_caching:
            layers = self.model.attention_layers
            tier = HostKVTier(lambda: [(a.k_cache, a.v_cache) for a in layers], self.config.block_size,
                              self.config.kv_spill_bytes, self.config.kv_spill_ttl)
        remote = None
        if self.config.kv_remote_url and self.config.enable_prefix_caching:
            layers = self.model.attention_layers
            remote = RedisKVTier(lambda: [(a.k_cache, a.v_cache) for a in layers], self.config.block_size,
                                 self.config.kv_remote_url, self.kv_namespace(), self.config.kv_remote_ttl)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching, tier, remote)
        sched_cfg = SchedulerConfig(self.config.max_batch_size, self.config.max_num_batched_tokens,
                                    self.max_model_len, self.config.chunked_prefill)
        # A method may know end-of-text ids the tokenizer files do not name (a model family's EOS).
        eos = list(dict.fromkeys(self.tokenizer.eos_token_ids + list(self.method.eos_token_ids)))
        self.scheduler = Scheduler(sched_cfg, self.block_manager, self.method, eos)
        self.decode_loop = MultiStep(self.runner, self.block_manager, self.sampler, self.method,
                                   self.config.num_scheduler_steps, self.max_model_len)
        self.stats = EngineStats()
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, self.method, self.stats)
        self.requests = self.output_processor.requests
        self._ids = itertools.count()

    def timed_step(self, rows: int, context: int) -> Callable[[], None]:
        """A step of `rows` query rows after `context` cached positions, built as this engine
        builds it (the runner's verify step of one request; one row: a step of the decode loop
        where it runs), writing its keys to blocks 0.. of whatever caches the attention layers
        hold: the confidence scheduler's cost profile swaps scratch caches in around it."""
        t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        bs = self.config.block_size
        table = list(range(-(-(context + rows) // bs)))
        loop = self.decode_loop.loop() if rows == 1 else None
        if loop is not None:
            call = LoopCall(t([0]), t([context]), t([table]), t([1]))
            return lambda: call.run(loop)
        seq = Sequence("profile", [0] * (context + rows), SamplingParams(max_tokens=1, temperature=0))
        seq.block_table, seq.num_computed = table, context
        batch = Batch([ScheduledSeq(seq, context, rows, 0, [0] * rows, rows)])
        return lambda: self.runner.run(batch)

    def _paged_runner(self, model: torch.nn.Module, num_blocks: int, block_size: int
                      ) -> tuple[ModelRunner, BlockManager]:
        """A second model's runner over a paged KV cache of its own (a draft model's), with its
        block manager (no prefix cache): MethodContext.paged_runner."""
        runner = ModelRunner(model, num_blocks, block_size, self.device, self.config.kv_torch_dtype(self.device))
        return runner, BlockManager(num_blocks, block_size, enable_prefix_caching=False)

    def kv_namespace(self) -> str:
        """What a KV block's contents depend on besides its tokens, as a short digest: the weights
        (the checkpoint's SHA256SUMS, else its config and weight files' names and sizes), the KV
        dtype and the block size. Replicas of one checkpoint agree; anything else never shares."""
        h = hashlib.sha256()
        sums = self.model_path / "SHA256SUMS"
        if sums.is_file():
            h.update(sums.read_bytes())
        else:
            h.update(json.dumps(self.hf_config, sort_keys=True, default=str).encode())
            for f in sorted(self.model_path.glob("*.safetensors")) + sorted(self.model_path.glob("*.bin")):
                h.update(f"{f.name}:{f.stat().st_size}".encode())
        h.update(f"{self.config.kv_torch_dtype(self.device)}|{self.config.block_size}".encode())
        return h.hexdigest()[:20]

    def _max_model_len(self) -> int:
        limit = int(self.hf_config.get("max_position_embeddings", 2048))
        return min(limit, self.config.max_model_len or limit)

    def _num_blocks(self) -> int:
        per_token = ModelRunner.kv_bytes_per_token(self.model, self.config.kv_torch_dtype(self.device))
        if self.config.kv_cache_tokens:
            tokens = self.config.kv_cache_tokens
        elif self.config.kv_cache_bytes:
            tokens = self.config.kv_cache_bytes // per_token
        else:  # enough for a full batch of full-length sequences, capped at 1 GiB
            tokens = min(self.config.max_batch_size * self.max_model_len, (1 << 30) // per_token)
        # Every rank schedules the same batches into the same blocks: the count all can hold
        # (pipeline stages may hold different numbers of layers).
        return agree_min(max(1, tokens // self.config.block_size))

    def parallel_stats(self) -> list[dict]:
        """Every rank's pipelined-step counters (runner.PipelineStats), in rank order: a
        collective, made by every rank at once (TensorParallelEngine.parallel_stats)."""
        return gather_objects(self.runner.pipeline_stats.as_dict())

    # --- requests -----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, stream: bool = True) -> str:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, not {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, not {type(request_id).__name__}")
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:     # lone surrogates: bytes that were not UTF-8
                raise ValueError(f"prompt is not valid Unicode text ({exc.reason} at character {exc.start})") from None
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, Integral) and not isinstance(t, bool)
                                                       for t in prompt):
            text, ids = None, [int(t) for t in prompt]
        else:      # (1.5 would have become token 1)
            raise TypeError(f"a prompt must be a string or a list of token ids, not {type(prompt).__name__} "
                            f"{str(prompt)[:60]!r}")
        if not ids:
            raise ValueError("prompt is empty")
        ids = self.model.prompt_ids(ids)
        if params.logits_processors and not self.method.supports_logits_processors:
            raise ParamError("logits_processors", f"logits_processors: the {self.method.name} method does not "
                                                  "support them")
        grammar = None
        if params.structured_outputs is not None:
            field = params.structured_outputs.field
            if not self.method.supports_logits_processors:
                raise ParamError(field, f"{field}: the {self.method.name} method cannot constrain its output")
            grammar = compiler_for(self.tokenizer, self.hf_config["vocab_size"]).matcher(params.structured_outputs)
        if params.prompt_logprobs is not None and not self.method.supports_prompt_logprobs:
            raise ParamError("prompt_logprobs", f"prompt_logprobs: the {self.method.name} method has no "
                                                "next-token distribution per prompt token")
        vocab = self.hf_config["vocab_size"]
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias):
            raise ParamError("logit_bias", f"logit_bias: token ids must be in [0, {vocab})")
        if params.allowed_token_ids is not None and any(t >= vocab for t in params.allowed_token_ids):
            raise ParamError("allowed_token_ids", f"allowed_token_ids: token ids must be in [0, {vocab})")
        prediction = params.prediction or []
        if isinstance(prediction, str):
            prediction = self.tokenizer.encode(prediction, add_special_tokens=False)
        elif any(t >= vocab for t in prediction):
            raise ParamError("prediction", f"prediction: token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but the model's context is "
                             f"{self.max_model_len} tokens")
        if params.n != 1:
            raise ParamError("n", f"n={params.n}: the engine takes one sequence a request; LLM.generate "
                                  "(and the server) run n of them")
        if params.max_tokens is None:       # as many as the context leaves (vLLM's None)
            params = replace(params, max_tokens=self.max_model_len - len(ids))
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, ids, params, priority=priority,
                       eos_token_ids=tuple(self.scheduler.eos_token_ids))
        seq.grammar = grammar
        seq.bad_words_ids = bad_words_ids(self.tokenizer, params.bad_words)
        seq.prediction_ids = list(prediction[:self.max_model_len])    # no reply is longer than this
        if params.seed is not None:
            seq.generator = self.sampler.make_generator(params.seed)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(ids)
        self.output_processor.add(seq, text, stream)
        self.scheduler.add(seq)
        self.stats.num_prompt_tokens += len(ids)
        return request_id

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(req.seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def interrupt_background(self) -> None:
        """(Any thread.) Live work arrived: a step of only background rows that is running stops
        at its next barrier, and a live multi-step decode call before its next step."""
        self.runner.interrupt.numpy()[0] = 1

    def clear_interrupt(self) -> None:
        """(The engine's thread, before it takes in new requests.)"""
        self.runner.interrupt.numpy()[0] = 0

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # --- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        changed: list[Sequence] = []
        if batch.seqs:
            changed = self._run_batch(batch)
            self.stats.num_steps += 1
        elsewhere = [s for s in self.scheduler.finished_outside_step
                     if s.request_id in self.requests and s not in changed]
        self.scheduler.finished_outside_step.clear()
        return self.output_processor.process(changed + elsewhere)

    def _run_batch(self, batch: Batch) -> list[Sequence]:
        """One forward over `batch`, committed. If preparing, running or committing raises, the
        batch is split in halves and each half is run on its own, down to the requests whose
        processing fails: those alone finish with an error, the rest of the batch goes on.
        Nothing was applied when it raised (KV slots past num_computed are rewritten next time),
        so a retried half starts from the same state."""
        try:
            plan = self.decode_loop.plan(batch, self.scheduler.num_admissible)
            if plan is not None:
                commits = self.decode_loop.run(batch, plan)
            else:
                self.method.prepare(batch)
                prompt_rows = mark_prompt_logit_rows(batch)
                out = self.runner.run(batch)
                if prompt_rows:
                    out, prompt_logits = split_prompt_logits(batch, out)
                commits = self.method.commit(batch, out)
                if prompt_rows:
                    record_prompt_logprobs(batch, prompt_logits)
        except StepInterrupted:             # background work gave way to live work: nothing kept
            self.stats.num_interrupted_steps += 1
            return []
        except Exception as exc:
            if len(batch.seqs) > 1:
                half = len(batch.seqs) // 2
                return (self._run_batch(replace(batch, seqs=batch.seqs[:half]))
                        + self._run_batch(replace(batch, seqs=batch.seqs[half:])))
            seq = batch.seqs[0].seq
            if isinstance(exc, ParamError):     # the request's own fault (a constraint past its limits): a 400
                log.warning("request %s failed in its step: %s", seq.request_id, exc)
                self.scheduler.finish(seq, f"error:param:{exc.field}:{exc}")
                return []
            log.exception("request %s failed in its step", seq.request_id)
            self.scheduler.finish(seq, f"error:{type(exc).__name__}: {exc}")
            return []
        return self.scheduler.apply(batch, commits)


# --- prompt logprobs (SamplingParams.prompt_logprobs) ----------------------------------------
def mark_prompt_logit_rows(batch: Batch) -> int:
    """Set each sequence's num_prompt_logits: the leading known rows of this step at prompt
    positions 0..P-2 (row p gives the distribution of prompt token p+1) of a request that asked
    for prompt logprobs. Returns their total. A decode step (one known token at the end) has
    none, so the C++ decode loop never needs them."""
    total = 0
    for s in batch.seqs:
        seq = s.seq
        rows = 0
        if seq.prompt_logprobs is not None:
            rows = max(0, min(s.start_pos + s.num_known, seq.num_prompt_tokens - 1) - s.start_pos)
        s.num_prompt_logits = rows
        total += rows
    return total


def split_prompt_logits(batch: Batch, out: StepOutput) -> tuple[StepOutput, torch.Tensor]:
    """The runner's logits hold each sequence's prompt rows before the method's rows: the
    method gets its own rows only (in batch order, as without prompt logprobs)."""
    own, prompt, row = [], [], 0
    for s in batch.seqs:
        prompt.extend(range(row, row + s.num_prompt_logits))
        row += s.num_prompt_logits
        own.extend(range(row, row + s.num_logits))
        row += s.num_logits
    index = lambda rows: torch.tensor(rows, dtype=torch.long, device=out.logits.device)  # noqa: E731
    return replace(out, logits=out.logits.index_select(0, index(own))), out.logits.index_select(0, index(prompt))


def record_prompt_logprobs(batch: Batch, logits: torch.Tensor) -> None:
    """Log-probabilities of the model's raw distribution at the prompt rows, in the format of
    the output tokens' (sampling.token_logprobs): written at the positions they score, so a
    preempted and recomputed prompt writes the same entries again."""
    lp = logits.float().log_softmax(-1)
    row = 0
    for s in batch.seqs:
        seq, n = s.seq, s.num_prompt_logits
        if not n:
            continue
        block = lp[row:row + n]
        targets = seq.token_ids[s.start_pos + 1:s.start_pos + 1 + n]
        chosen = block.gather(1, torch.tensor(targets, device=block.device).unsqueeze(1))
        ranks = (block > chosen).sum(-1).add(1).tolist()        # 1: the most likely token
        k = seq.params.prompt_logprobs
        tops = block.topk(k, dim=-1) if k else None
        for j, (t, v) in enumerate(zip(targets, chosen.squeeze(1).tolist())):
            top = list(zip(tops.indices[j].tolist(), tops.values[j].tolist())) if tops is not None else []
            seq.prompt_logprobs[s.start_pos + 1 + j] = {"token_id": t, "logprob": v, "rank": ranks[j], "top": top}
        row += n
