"""Continuous-batching sampler: requests in, one bounded decode chunk per `step`, finished samples out.

The sampler owns a fixed set of decode rows (at most `max_rows`) backed by one preallocated KV cache
whose row count and length are bucketed, so a workload compiles a handful of shapes. Each `step`
(1) admits waiting requests in FIFO order while rows are free, (2) resizes the cache when the active
set moves to another row or length bucket (rows are compacted, so a lone request decodes at batch 1
unless a bucket up to 4x larger has run and batch 1 has not: see `_fit_cache`),
(3) prefills the admitted prompts once each and copies their cache into all their sample rows,
(4) runs one jitted chunk of `chunk_steps` decode steps over every row, and (5) retires rows whose
`StopChecker` fires. A row carries its own adapter slot, sampling parameters and seed, so requests of
different users and adapters share a batch, and a row's tokens depend only on its seed, its
generated-token index and its logits, never on its neighbours. Weights are read through `get_state()`
at every device call; the caller gives each sampler an immutable slot for snapshot isolation. One
`step` does at most one decode chunk (plus a prefill capped by `max_prefill_tokens`), so a training
step interleaved between steps waits at most that long.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Protocol

import jax
import numpy as np
from flax import nnx

from tx.engine.batching import bucket_size
from tx.engine.cache_budget import CacheBudget, cache_bytes_of
from tx.engine.decode_steps import Cache, DecodePrograms, Fresh, Weights
from tx.engine.prompt_cache import Key, PromptCache
from tx.engine.sampler_rows import (
    Job,
    Row,
    copy_sources,
    decode_rows,
    plan_admission,
    prefill_batch,
    prompt_results,
    queue_fairly,
    row_slots,
    warm_bucket,
)
from tx.engine.sampling import StopChecker, resolve_seed, sample_seeds
from tx.engine.text import has_text
from tx.gather import to_host
from tx.lora.params import AdapterRoles
from tx.lora.select import Selection, select
from tx.models.config import ModelConfig
from tx.protocol import RequestError, SampleRequest, SampleResult

log = logging.getLogger(__name__)
SCORE_TOPK = 20  # the prompt top-k width every request up to it is scored at (the API's default limit)

Outcome = tuple[str, SampleResult | RequestError]


def powers_of_two(smallest: int, largest: int) -> tuple[int, ...]:
    """1, 2, 4, ... from `smallest` (rounded down to a power of two) to `largest`, with `largest` last."""
    sizes, size = {largest}, 1
    while size < largest:
        if size * 2 > smallest:
            sizes.add(size)
        size *= 2
    return tuple(sorted(sizes))


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Engine knobs for sampling. Empty bucket tuples take the defaults (powers of two)."""

    max_rows: int = 64  # decode rows at most
    max_seq_len: int = 2048  # prompt + generated tokens per row at most
    chunk_steps: int = 16  # decode steps per jitted call
    k_cap: int = 64  # widest top-k served from the batch's candidates (past it, per-row thresholds)
    max_prefill_tokens: int = 8192  # padded prompt tokens prefilled per step (the first request always goes)
    prompt_cache_bytes: int = 256 << 20  # prefilled prompts kept for reuse (0 = off)
    row_buckets: tuple[int, ...] = ()  # decode (and prefill) row counts
    length_buckets: tuple[int, ...] = ()  # cache lengths and prompt lengths
    # The decode cache's form between chunks: per layer (`LayerCache`) for per-layer weights, else stacked
    # (`KVCache`); it should match the weights' form (`Tuning.per_layer_decode`), or each chunk converts it.
    layer_cache: bool = True
    cache_limit_bytes: int | None = None  # the decode cache's bytes at most; None: follow free memory

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_seq_len", "chunk_steps", "k_cap", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"SamplerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_cache_bytes < 0:
            raise ValueError(f"SamplerConfig.prompt_cache_bytes must be >= 0, got {self.prompt_cache_bytes}")
        if not self.row_buckets:
            object.__setattr__(self, "row_buckets", powers_of_two(1, self.max_rows))
        if not self.length_buckets:
            object.__setattr__(self, "length_buckets", powers_of_two(min(128, self.max_seq_len), self.max_seq_len))
        if self.row_buckets[-1] < self.max_rows or self.length_buckets[-1] < self.max_seq_len:
            raise ValueError("the largest buckets must hold max_rows rows and max_seq_len positions")
        if list(self.row_buckets) != sorted(self.row_buckets) or list(self.length_buckets) != sorted(
            self.length_buckets
        ):
            raise ValueError("buckets must be sorted ascending")


class AdapterView(Protocol):
    """What a sampler reads of an adapter bank (`tx.engine.bank.AdapterBank`)."""

    @property
    def scale(self) -> np.ndarray:
        """[S, R] float32: each slot's scaling on its live rank columns (host memory)."""
        ...

    def weights_version(self) -> Hashable:
        """A value that changes whenever an adapter weight or scale changes; None: not versioned."""
        ...

    @property
    def roles(self) -> AdapterRoles:
        """Which weights are LoRA A and B factors (from their variable types)."""
        ...


class Sampler:
    """The continuous-batching sampling engine (see the module docstring)."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        get_state: Callable[[], Weights],
        model_cfg: ModelConfig,
        cfg: SamplerConfig,
        eos_token_ids: Sequence[int],
        decode: Callable[[list[int]], str],
        adapters: AdapterView | None,
        programs: DecodePrograms | None = None,
    ) -> None:
        """`adapters`: the model's adapter bank (its scale table, and its weights version), None for a model
        without adapters; `get_state()` returns the base weights and the bank's arrays. `programs`: share
        another sampler's compiled programs (same graph and config), e.g. the sampler of a full fine-tuning
        snapshot reuses the base sampler's compiles. When the bank has a version, prefilled prompts are kept
        for reuse (`PromptCache`)."""
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.get_state = get_state
        self.lora_scale: Callable[[], np.ndarray] | None = None if adapters is None else (lambda: adapters.scale)
        self.eos_token_ids = tuple(eos_token_ids)
        self.decode = decode
        roles = None if adapters is None else adapters.roles
        self.programs = programs or DecodePrograms(graphdef, cfg.chunk_steps, cfg.k_cap, roles)
        versioned = adapters is not None and adapters.weights_version() is not None
        self.weights_version = adapters.weights_version if versioned and adapters is not None else None
        self.prefill_count = 0  # prompts prefilled (one per distinct prompt of an admission, cache misses only)
        self._prompt_cache = PromptCache(cfg.prompt_cache_bytes)
        self._waiting: deque[Job] = deque()
        self._outbox: list[Outcome] = []
        self._rows: list[Row | None] = []  # one entry per cache row
        self._cache: Cache | None = None
        self.budget = CacheBudget(cache_bytes_of(model_cfg, cfg.layer_cache), cfg.row_buckets, cfg.cache_limit_bytes)
        self._row_cap = cfg.max_rows  # rows the cache may hold at its rows' final length (`_admit`)
        self._decoded: set[tuple[int, int]] = set()  # (rows, length) decode shapes used so far
        # (rows, prompt length) prefill shapes used so far, without and with prompt scores
        self._prefilled: dict[bool, set[tuple[int, int]]] = {False: set(), True: set()}

    @property
    def compile_count(self) -> int:
        return self.programs.compile_count

    @property
    def cache_shape(self) -> tuple[int, int] | None:
        """(rows, length) of the decode cache, None while nothing is decoding."""
        return None if self._cache is None else (self._cache.rows, self._cache.length)

    def idle(self) -> bool:
        return not (self._waiting or self._outbox or any(self._rows))

    def slots_in_use(self) -> set[int]:
        """Adapter slots that waiting or decoding requests read: they must not be evicted or rewritten."""
        return {job.slot for job in self._waiting} | {row.job.slot for row in self._rows if row is not None}

    def submit(self, request_id: str, req: SampleRequest, slot: int, group: str = "") -> None:
        """Queue a request sampled with the weights in adapter `slot`; errors come out of the next `step`.
        Requests wait round-robin by `group` (the sampling session: `queue_fairly`)."""
        try:
            self._validate(req, slot)
            stop = StopChecker(
                [*(self.eos_token_ids if req.params.stop_at_eos else ()), *req.params.stop_token_ids],
                req.params.stop_strings,
                lambda ids: self.decode(list(ids)),
                req.params.max_tokens,
            )
        except (RequestError, ValueError) as err:
            self._outbox.append((request_id, err if isinstance(err, RequestError) else RequestError(str(err), "user")))
            return
        seeds = sample_seeds(resolve_seed(req.params.seed, request_id), req.num_samples)
        queue_fairly(self._waiting, Job(request_id, req, slot, seeds, stop, group=group))

    def step(self) -> list[Outcome]:
        """Admit waiting requests, run one decode chunk, return the requests that finished."""
        out, self._outbox = self._outbox, []
        new_rows = self._admit()
        try:
            if new_rows or any(self._rows):
                self._fit_cache([row for row in self._rows if row is not None], new_rows)
            if new_rows:
                self._prefill(new_rows)
            if any(self._rows):
                out.extend(self._decode_chunk())
        except Exception as err:  # a failed device call loses the cache: fail what it held, keep serving
            log.exception("sampler step failed")
            out.extend(self._fail_active(f"sampling failed: {type(err).__name__}: {err}", new_rows))
        if not any(self._rows):
            self._cache, self._rows = None, []  # give the cache's memory back while idle
        return out

    # ---- admission ------------------------------------------------------------------------------

    def _validate(self, req: SampleRequest, slot: int) -> None:
        """What only the engine knows: the request fits this sampler's rows and slot table. Everything
        about the request itself was checked before it was queued (`tx.api.validate`), except that a row
        cannot start without a prompt token, which this sampler relies on."""
        if not req.prompt:
            raise RequestError("the prompt is empty: sampling needs at least one prompt token", "user")
        if req.params.stop_strings and not has_text(self.decode):  # they could never match: refused, not ignored
            raise RequestError(
                "sampling_params.stop: this model has no tokenizer, so stop strings cannot be matched; "
                "stop on token ids instead",
                "user",
            )
        if len(req.prompt) + req.params.max_tokens - 1 > self.cfg.max_seq_len:  # the last token takes no position
            raise RequestError(
                f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.params.max_tokens}) exceeds the sampler's "
                f"max_seq_len of {self.cfg.max_seq_len} tokens",
                "user",
            )
        slots = 1 if self.lora_scale is None else int(self.lora_scale().shape[0])
        if not 0 <= slot < slots:
            raise RequestError(f"adapter slot {slot} does not exist (the model has {slots})", "server")
        length = bucket_size(len(req.prompt) + req.params.max_tokens - 1, self.cfg.length_buckets)
        self.budget.check_alone(length)

    def _admit(self) -> list[Row]:
        """Take waiting requests into new rows (host bookkeeping only: `_fit_cache` places them)."""
        if not self._waiting:
            return []  # rows only leave: the cap stays as it was
        active = [row for row in self._rows if row is not None]
        waiting = [(job.req.num_samples - job.admitted, len(job.req.prompt)) for job in self._waiting]
        self._row_cap = cap = min(self.cfg.max_rows, self._rows_that_fit(active))
        counts = plan_admission(waiting, max(cap - len(active), 0), cap, self.cfg.max_prefill_tokens)
        new_rows: list[Row] = []
        for take in counts:
            job = self._waiting[0]
            new_rows.extend(Row.start(job, sample) for sample in range(job.admitted, job.admitted + take))
            job.admitted += take
            if job.admitted == job.req.num_samples:
                self._waiting.popleft()
        return new_rows

    def _rows_that_fit(self, active: list[Row]) -> int:
        """Rows whose cache fits the budget at the longest final length of the active and waiting rows."""
        ends = [row.last_useful for row in active]
        ends += [len(job.req.prompt) + job.req.params.max_tokens - 1 for job in self._waiting]
        if not ends:
            return self.cfg.max_rows
        return self.budget.row_cap(bucket_size(max(ends), self.cfg.length_buckets), self._held_bytes())

    def _held_bytes(self) -> int:
        return sum(int(x.nbytes) for x in jax.tree.leaves(self._cache)) if self._cache is not None else 0

    def _fit_cache(self, active: list[Row], new_rows: list[Row]) -> None:
        """Move to the row and length buckets the next chunk needs, compacting rows; place the new rows.

        A row bucket never decoded at this length gives way to a larger one (up to 4x) that has been: a
        client's burst of sample calls that reaches the engine in two parts would otherwise compile a
        shape for the first part just before the rest joins it (3.4 s on `small` when 32 SDK calls split
        10 + 22). The rows still shrink to a bucket that has run before, or by more than 4x."""
        need = max(row.need(self.cfg.chunk_steps) for row in [*active, *new_rows])
        length = bucket_size(need, self.cfg.length_buckets)
        count = len(active) + len(new_rows)
        # a larger compiled row bucket only within the budget
        buckets = [b for b in self.cfg.row_buckets if b <= max(self._row_cap, bucket_size(count, self.cfg.row_buckets))]
        rows = warm_bucket(count, buckets, self._decoded, length)
        self._decoded.add((rows, length))
        if self._cache is None:
            self._cache = self.programs.empty(self.model_cfg, rows, length, self.cfg.layer_cache)
            self._rows = [None] * rows
        elif self.cache_shape != (rows, length):
            live = [i for i, row in enumerate(self._rows) if row is not None]
            padded = np.array(live + [0] * (rows - len(live)), np.int32)
            self._cache = self.programs.resize(self._cache, padded, length=length)
            self._rows = [*active, *[None] * (rows - len(active))]
        free = (i for i, row in enumerate(self._rows) if row is None)
        for row, index in zip(new_rows, free, strict=False):
            self._rows[index] = row
        if new_rows and self._cache.stateful:  # recurrent state left by a row's previous occupant
            placed = {id(row) for row in new_rows}
            new = np.array([row is not None and id(row) in placed for row in self._rows])
            self._cache = self.programs.clear(self._cache, new)

    def _prefill(self, new_rows: list[Row]) -> None:
        """Give every admitted row its prompt's cache: each distinct prompt is prefilled once (rows of one
        request, and requests with the same prompt and weights, share it), or copied from the prompt cache."""
        assert self._cache is not None
        jobs = list({id(row.job): row.job for row in new_rows if len(row.job.req.prompt) > 1}.values())
        if not jobs:
            return
        pieces: list[Job] = []  # one prefill row each
        piece_of: dict[int, int] = {}  # id(job) -> its prefill row
        first_of: dict[Key, int] = {}
        hits: dict[Key, tuple[Fresh, list[Job]]] = {}
        for job in jobs:
            key = self._prompt_key(job)
            if key is not None and key in first_of:  # the same prompt and weights earlier in this admission
                piece_of[id(job)] = first_of[key]
                continue
            if key is not None and key in hits:
                hits[key][1].append(job)
                continue
            entry = None if key is None or self.weights_version is None else self._prompt_cache.get(key)
            if key is not None and entry is not None:
                hits[key] = (entry, [job])
                continue
            if key is not None:
                first_of[key] = len(pieces)
            piece_of[id(job)] = len(pieces)
            pieces.append(job)
        if pieces:
            keep = first_of if self.weights_version is not None else {}
            self._prefill_pieces(pieces, copy_sources(self._rows, new_rows, piece_of), keep)
        for entry, sharing in hits.values():
            source = copy_sources(self._rows, new_rows, {id(job): 0 for job in sharing})
            self._cache = self.programs.insert(self._cache, entry, source)

    def _prefill_pieces(self, pieces: list[Job], source: np.ndarray, keys: dict[Key, int]) -> None:
        """Prefill the prompts that asked for their scores apart from the rest, so that only their rows
        compute full-vocabulary logits. `source` and `keys` index `pieces`; each group gets its own."""
        wants = [job.wants_prompt_scores() for job in pieces]
        for scored in (False, True):
            group = [i for i, want in enumerate(wants) if want == scored]
            if not group:
                continue
            local = {piece: j for j, piece in enumerate(group)}
            group_source = np.array([local.get(int(piece), -1) for piece in source], np.int32)
            group_keys = {key: local[i] for key, i in keys.items() if i in local}
            self._prefill_group([pieces[i] for i in group], group_source, group_keys, scored)

    def _prefill_group(self, pieces: list[Job], source: np.ndarray, keys: dict[Key, int], scored: bool) -> None:
        assert self._cache is not None
        used = self._prefilled[scored]
        batch, slots = prefill_batch(pieces, self.cfg.row_buckets, self.cfg.length_buckets, used)
        used.add((batch.tokens.shape[0], batch.tokens.shape[1]))
        topk = max((job.req.topk_prompt_logprobs for job in pieces), default=0) if scored else 0
        # One width for every top-k up to SCORE_TOPK: each width is a full-model prefill compile, and a
        # tenant stepping through 1, 2, 3, 4, 6, ... would stall every other tenant's sampling meanwhile.
        topk = min(bucket_size(max(topk, SCORE_TOPK)), self.model_cfg.vocab_size) if topk else 0
        adapters = self._adapters(slots)
        fresh, scores = self.programs.prefill(self.get_state(), adapters, batch, scores=scored, topk=topk)
        self._cache = self.programs.insert(self._cache, fresh, source)
        self.prefill_count += len(pieces)
        for key, index in keys.items():  # keep each prompt's own length bucket of its rows
            length = bucket_size(len(pieces[index].req.prompt) - 1, self.cfg.length_buckets)
            self._prompt_cache.put(key, self.programs.head(fresh, index, length=length))
        if scores is not None:
            prompt_results(pieces, scores)

    def _prompt_key(self, job: Job) -> Key | None:
        """What a prompt's cache depends on (the weights version is None when the sampler has none: such
        keys only match within one admission); None when the prompt must be computed for itself because
        its scores were asked for. The base weights (slot 0) serve every tenant: their entries are kept per
        sampling session, or a tenant could time a guessed prompt to learn whether another had sent it."""
        if job.wants_prompt_scores():
            return None
        version = None if self.weights_version is None else self.weights_version()
        return (version, job.slot, job.group if job.slot == 0 else "", tuple(job.req.prompt[:-1]))

    # ---- decoding -------------------------------------------------------------------------------

    def _decode_chunk(self) -> list[Outcome]:
        assert self._cache is not None
        rows = decode_rows(self._rows, self._cache.length)
        adapters = self._adapters(row_slots(self._rows))
        self._cache, tokens_BC, logprobs_BC = self.programs.decode(self.get_state(), adapters, self._cache, rows)
        tokens_BC, logprobs_BC = to_host(tokens_BC), to_host(logprobs_BC)
        out: list[Outcome] = []
        for index, row in enumerate(self._rows):
            if row is None or self._rows[index] is not row:  # empty, or its request was retired meanwhile
                continue
            try:
                if row.advance(tokens_BC[index], logprobs_BC[index]):
                    self._rows[index] = None
                    if row.job.done():
                        out.append((row.job.request_id, row.job.result()))
            except Exception as err:  # this row's own bookkeeping (stop strings, results): retire its request alone
                log.warning("sample %s failed", row.job.request_id, exc_info=True)
                out.append(self._retire(row.job, f"sampling failed: {type(err).__name__}: {err}"))
        return out

    def _retire(self, job: Job, message: str) -> Outcome:
        """Drop every row and waiting entry of `job` and fail it."""
        self.discard({job.request_id})
        return job.request_id, RequestError(message, "server")

    def discard(self, request_ids: Collection[str]) -> None:
        """Forget requests failed elsewhere (by the engine loop, after an unexpected error): their rows stop
        and are free, their waiting samples never start, and no outcome is reported for them."""
        self._rows = [None if row is not None and row.job.request_id in request_ids else row for row in self._rows]
        self._waiting = deque(job for job in self._waiting if job.request_id not in request_ids)
        self._outbox = [outcome for outcome in self._outbox if outcome[0] not in request_ids]

    def _adapters(self, slots: np.ndarray) -> Selection | None:
        return None if self.lora_scale is None else select(slots, np.asarray(self.lora_scale()))

    def _fail_active(self, message: str, new_rows: Sequence[Row]) -> list[Outcome]:
        """Fail every request with a row in the cache (the cache is gone), and those given rows this step
        (`new_rows`, which may not be in the table yet)."""
        held = [row for row in self._rows if row is not None] + list(new_rows)
        jobs = {row.job.request_id: row.job for row in held}
        self._waiting = deque(job for job in self._waiting if job.request_id not in jobs)
        self._rows, self._cache = [], None
        return [(request_id, RequestError(message, "server")) for request_id in jobs]
