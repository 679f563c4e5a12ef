"""Padding waste of packing plus micro-batching on sequence lengths uniform in 100..1000; prints JSON."""

import argparse
import json

import numpy as np

from tx.engine.batching import DEFAULT_MICRO_BATCH_TOKENS, DEFAULT_ROW_TOKENS, micro_batches, pack_sequences


def measure(num_datums: int, row_tokens: int, max_tokens: int, trials: int) -> dict[str, float | int]:
    rng = np.random.default_rng(0)
    packed, batched, shapes = [], [], set()
    for _ in range(trials):
        plan = pack_sequences(rng.integers(100, 1001, num_datums).tolist(), row_tokens)
        pieces = micro_batches(plan, max_tokens)
        packed.append(plan.waste)
        batched.append(pieces.waste)
        shapes.update(batch.shape for batch in pieces.batches)
    return {
        "datums": num_datums,
        "row_tokens": row_tokens,
        "micro_batch_tokens": max_tokens,
        "pack_waste_mean": round(float(np.mean(packed)), 4),
        "waste_mean": round(float(np.mean(batched)), 4),
        "waste_max": round(float(np.max(batched)), 4),
        "distinct_shapes": len(shapes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--datums", type=int, nargs="+", default=[16, 32, 64, 128, 256, 1024])
    parser.add_argument("--row-tokens", type=int, default=DEFAULT_ROW_TOKENS)
    parser.add_argument("--micro-batch-tokens", type=int, default=DEFAULT_MICRO_BATCH_TOKENS)
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    for num_datums in args.datums:
        print(json.dumps(measure(num_datums, args.row_tokens, args.micro_batch_tokens, args.trials)))


if __name__ == "__main__":
    main()
