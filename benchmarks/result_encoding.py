"""What a large sample result costs the engine thread, and the API thread that renders it (JSON output).

The engine thread keeps a finished sample's prompt scores (`Job.score_prompt`) and stores the result
(`tx.db.codec.encode`, the queue's blob); every other tenant's steps wait meanwhile. The API decodes the
blob and renders JSON or protobuf in its thread pool. Two results at the server's limits: `sequences`,
`--samples` samples of `--tokens` tokens each (token ids and logprobs); `prompt_scores`, a `--prompt`-token
prompt's logprobs and its top `--topk`. Medians of `--repeats`, milliseconds.

    python benchmarks/result_encoding.py            # 128 x 4095 samples, a 4096-token prompt's top 20
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tx.api.wire_encode import result_json, result_proto
from tx.db import codec
from tx.engine.sampler_rows import Job
from tx.engine.sampling import StopChecker
from tx.protocol import SampledSequence, SampleRequest, SampleResult, SamplingParams


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def _sequences(samples: int, tokens: int, rng: np.random.Generator) -> SampleResult:
    def one() -> SampledSequence:
        logprobs = [float(x) for x in rng.standard_normal(tokens).astype(np.float32)]
        return SampledSequence(rng.integers(0, 150_000, tokens).tolist(), logprobs, "length")

    return SampleResult([one() for _ in range(samples)])


def _scored_job(prompt: int, topk: int) -> Job:
    req = SampleRequest(
        list(range(prompt)), 1, SamplingParams(max_tokens=1), "m", prompt_logprobs=True, topk_prompt_logprobs=topk
    )
    job = Job("r", req, 0, [0], StopChecker([], [], lambda ids: "", 1))
    job.sequences[0] = SampledSequence([1], [-0.5], "length")
    return job


def _costs(result: SampleResult, repeats: int) -> dict[str, Any]:
    blob = codec.encode(result)
    stored = codec.decode(blob)
    return {
        "blob_mib": round(len(blob) / 2**20, 2),
        "engine_encode_ms": _median_ms(lambda: codec.encode(result), repeats),
        "api_decode_ms": _median_ms(lambda: codec.decode(blob), repeats),
        "api_protobuf_ms": _median_ms(lambda: result_proto(stored), repeats),
        "api_json_ms": _median_ms(lambda: result_json(stored), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=4095)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    n = args.prompt - 1
    scores = (rng.standard_normal(n), rng.integers(0, 150_000, (n, args.topk)), rng.standard_normal((n, args.topk)))
    job = _scored_job(args.prompt, args.topk)

    def keep_scores() -> None:
        job.prompt_logprobs = job.topk_prompt_logprobs = None
        job.score_prompt(*scores)

    keep_scores()
    report = {
        "benchmark": "result_encoding",
        "machine": platform.processor() or platform.machine(),
        "args": vars(args),
        "sequences": _costs(_sequences(args.samples, args.tokens, rng), args.repeats),
        "prompt_scores": {
            "engine_keep_scores_ms": _median_ms(keep_scores, args.repeats),
            **_costs(job.result(), args.repeats),
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
