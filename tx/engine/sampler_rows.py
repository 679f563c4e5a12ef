"""Host-side bookkeeping of the sampler: requests (`Job`), decode rows (`Row`) and the arrays built from them.

A `Job` is one submitted request: its stop checker, one seed per sample, and the sequences finished so
far. A `Row` is one sample being decoded: the token it feeds next, the position it goes to, and what it
has generated. Positions follow the protocol's prompt indexing: the prompt's first `len - 1` tokens are
prefilled, the first decode step feeds the last prompt token at position `len - 1` and samples generated
token 0. The functions here turn rows into the numpy inputs of `decode_steps` and read results back.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence

import numpy as np

from tx.engine.batching import bucket_size
from tx.engine.decode_steps import DecodeRows, PrefillBatch, PromptScores
from tx.engine.sampling import StopChecker, greedy_below
from tx.gather import to_host
from tx.protocol import SampledSequence, SampleRequest, SampleResult, TopkLogprobs


@dataclasses.dataclass(eq=False)
class Job:
    """One request: `admitted` samples have rows (or are done); `sequences` maps sample index -> result."""

    request_id: str
    req: SampleRequest
    slot: int
    seeds: list[int]
    stop: StopChecker
    admitted: int = 0
    group: str = ""  # whose turn it takes in the queue (`queue_fairly`): its sampling session
    turn: int = 0
    sequences: dict[int, SampledSequence] = dataclasses.field(default_factory=dict)
    prompt_logprobs: np.ndarray | None = None
    topk_prompt_logprobs: TopkLogprobs | None = None

    def wants_prompt_scores(self) -> bool:
        wanted = self.req.prompt_logprobs or self.req.topk_prompt_logprobs > 0
        return wanted and self.prompt_logprobs is None and self.topk_prompt_logprobs is None

    def done(self) -> bool:
        return len(self.sequences) == self.req.num_samples

    def result(self) -> SampleResult:
        if len(self.req.prompt) == 1 and self.wants_prompt_scores():
            # A one-token prompt has nothing to score: its only entry is the undefined first one.
            k = self.req.topk_prompt_logprobs
            self.score_prompt(np.zeros(0, np.float32), np.zeros((0, k), np.int32), np.zeros((0, k), np.float32))
        sequences = [self.sequences[i] for i in range(self.req.num_samples)]
        last_n = self.req.prompt_logprobs_last_n
        scored_from = len(self.req.prompt) - last_n if last_n else 1
        return SampleResult(sequences, self.prompt_logprobs, self.topk_prompt_logprobs, scored_from)

    def score_prompt(self, logprobs_N: np.ndarray, ids_NK: np.ndarray, top_NK: np.ndarray) -> None:
        """Keep the scores this request asked for, given those of prompt[1:] (`ids_NK`/`top_NK` at least as
        wide as its k); entry 0, before the first token, is undefined."""
        if self.req.prompt_logprobs:
            self.prompt_logprobs = np.concatenate([np.full(1, np.nan, np.float32), logprobs_N.astype(np.float32)])
        if k := min(self.req.topk_prompt_logprobs, ids_NK.shape[1]):  # no wider than the vocabulary
            ids = np.zeros((len(ids_NK) + 1, k), np.int32)
            top = np.full((len(top_NK) + 1, k), np.nan, np.float32)
            ids[1:], top[1:] = ids_NK[:, :k], top_NK[:, :k]
            self.topk_prompt_logprobs = TopkLogprobs(ids, top)


@dataclasses.dataclass(eq=False)
class Row:
    """One sample in decode: feeds `token` at `position` next; `tokens`/`logprobs` are what it generated."""

    job: Job
    sample: int
    token: int
    position: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)

    @staticmethod
    def start(job: Job, sample: int) -> Row:
        return Row(job, sample, job.req.prompt[-1], len(job.req.prompt) - 1)

    @property
    def last_useful(self) -> int:
        """The cache positions the row may ever need: its prompt and max_tokens, less the last token's."""
        return len(self.job.req.prompt) + self.job.req.params.max_tokens - 1

    def need(self, chunk_steps: int) -> int:
        """Cache positions the next chunk touches; past the row's last useful position writes may drop."""
        return min(self.position + chunk_steps, self.last_useful)

    def advance(self, tokens_C: np.ndarray, logprobs_C: np.ndarray) -> bool:
        """Append one chunk's output; True (and the job's sequence recorded) once the row is finished."""
        self.tokens.extend(int(t) for t in tokens_C)
        self.logprobs.extend(float(lp) for lp in logprobs_C)
        self.token = self.tokens[-1]
        self.position += len(tokens_C)
        finish = self.job.stop.check(self.tokens, len(tokens_C))
        if finish is None:
            return False
        n = finish.num_tokens
        self.job.sequences[self.sample] = SampledSequence(self.tokens[:n], self.logprobs[:n], finish.reason)
        return True


def decode_rows(table: Sequence[Row | None], length: int) -> DecodeRows:
    """The decode chunk's per-row inputs; empty rows sit at position `length`, where writes drop."""
    B = len(table)
    token, position, step = np.zeros(B, np.int32), np.full(B, length, np.int32), np.zeros(B, np.int32)
    seed, top_k = np.zeros(B, np.uint32), np.zeros(B, np.int32)
    temperature, top_p = np.zeros(B, np.float32), np.ones(B, np.float32)
    for i, row in enumerate(table):
        if row is None:
            continue
        p = row.job.req.params
        token[i], position[i], step[i] = row.token, row.position, len(row.tokens)
        seed[i] = row.job.seeds[row.sample]
        temperature[i], top_k[i], top_p[i] = greedy_below(p.temperature), p.top_k, p.top_p
    return DecodeRows(token, position, step, seed, temperature, top_k, top_p)  # type: ignore[arg-type]


def row_slots(table: Sequence[Row | None]) -> np.ndarray:
    """The adapter slot of every decode row (0 for empty rows)."""
    return np.array([0 if row is None else row.job.slot for row in table], np.int32)


def warm_bucket(n: int, buckets: Sequence[int], used: set[tuple[int, int]], other: int, reach: int = 4) -> int:
    """The bucket for `n` rows; when that shape has not run with `other` (the shape's second dimension)
    but a larger bucket at most `reach` times its size has, the smallest such one: a compiled shape
    with some idle rows in place of compiling another."""
    exact = bucket_size(n, buckets)
    if (exact, other) in used:
        return exact
    for size in buckets:
        if exact < size <= reach * exact and (size, other) in used:
            return size
    return exact


def queue_fairly(waiting: deque[Job], job: Job) -> None:
    """Queue `job` round-robin by group: its turn is one past its group's last waiting job (0 when it has none),
    and it goes behind every waiting job of the same or an earlier turn (the queue stays sorted by turn). One
    client's backlog then delays another client's next request by one of its requests, not by all of them;
    a single group keeps its order (FIFO)."""
    turns = [other.turn for other in waiting if other.group == job.group]
    job.turn = max(turns) + 1 if turns else 0
    at = len(waiting)
    while at > 0 and waiting[at - 1].turn > job.turn:
        at -= 1
    waiting.insert(at, job)


def plan_admission(waiting: Sequence[tuple[int, int]], free_rows: int, max_rows: int, prefill_budget: int) -> list[int]:
    """How many samples of each waiting (samples left, prompt length) entry to admit now, FIFO.

    A request is admitted whole so that its prompt is prefilled once; one with more samples than
    `max_rows` can never fit and takes whatever rows are free (its later pieces prefill again). The
    queue stops at the first request that does not fit, so large requests are not starved. The prefill
    pads every prompt to the longest admitted one, so it is the padded count (admitted prompts x the
    longest) that stays within `prefill_budget`, except that the first admitted request always goes: one
    long prompt among many short ones would otherwise make a prefill many times the budget.
    """
    counts: list[int] = []
    longest = 0
    for samples, prompt_len in waiting:
        take = min(samples, free_rows) if samples > max_rows else (samples if samples <= free_rows else 0)
        if take == 0 or (counts and (len(counts) + 1) * max(longest, prompt_len) > prefill_budget):
            break
        counts.append(take)
        free_rows -= take
        longest = max(longest, prompt_len)
    return counts


def prefill_batch(
    jobs: Sequence[Job],
    row_buckets: Sequence[int],
    length_buckets: Sequence[int],
    used: set[tuple[int, int]] | None = None,
) -> tuple[PrefillBatch, np.ndarray]:
    """One prefill row per job (each with a prompt of 2+ tokens), and the adapter slot of each row.
    `used`: the (rows, length) shapes prefilled before (see `warm_bucket`)."""
    P = bucket_size(max(len(job.req.prompt) - 1 for job in jobs), length_buckets)
    N = warm_bucket(len(jobs), row_buckets, used or set(), P)
    tokens, targets = np.zeros((N, P), np.int32), np.zeros((N, P), np.int32)
    positions, slot = np.full((N, P), P, np.int32), np.zeros(N, np.int32)
    for i, job in enumerate(jobs):
        prompt = job.req.prompt
        n = len(prompt) - 1
        tokens[i, :n], targets[i, :n], positions[i, :n] = prompt[:-1], prompt[1:], np.arange(n)
        slot[i] = job.slot
    return PrefillBatch(tokens, positions, targets), slot  # type: ignore[arg-type]


def copy_sources(table: Sequence[Row | None], new_rows: Sequence[Row], piece_of: dict[int, int]) -> np.ndarray:
    """For every decode row, the prefill row (piece) it copies its prompt cache from; -1: none.
    `piece_of` maps id(job) -> piece index; only newly admitted rows copy."""
    fresh = {id(row) for row in new_rows}
    return np.array(
        [piece_of.get(id(row.job), -1) if row is not None and id(row) in fresh else -1 for row in table], np.int32
    )


def prompt_results(jobs: Sequence[Job], scores: PromptScores) -> None:
    """Fill in the prompt logprobs of the jobs that asked: entry j scores prompt[j]; entry 0 is undefined."""
    logprobs, ids, top = (to_host(x) for x in (scores.logprobs, scores.topk_ids, scores.topk_logprobs))
    for i, job in enumerate(jobs):
        if job.wants_prompt_scores():
            n = len(job.req.prompt) - 1
            job.score_prompt(logprobs[i, :n], ids[i, :n], top[i, :n])
