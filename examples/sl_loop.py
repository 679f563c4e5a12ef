"""Supervised fine-tuning with the plain `tinker` SDK: a few short sentences, next-token cross-entropy.

Runs unchanged against SmolGym or any Tinker service:
    TINKER_BASE_URL=http://localhost:8000 TINKER_API_KEY=tml-local python examples/sl_loop.py --base-model DIR
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import tinker
from loop_tokenizer import load_tokenizer
from tinker import types

SENTENCES = [
    "The cat sat on the warm mat.",
    "The dog ran across the green field.",
    "The sun was bright and the sky was blue.",
    "She makes bread, cakes and small sweet rolls.",
    "The river runs down from the hills to the sea.",
    "Hello and goodbye are short words.",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-model", default=os.environ.get("TINKER_BASE_MODEL"), help="default: $TINKER_BASE_MODEL")
    p.add_argument(
        "--tokenizer", help="a tokenizer directory or hub name (default: the server's; needed for an upload:NAME model)"
    )
    p.add_argument("--steps", type=int, default=10, help="default: %(default)s")
    p.add_argument("--learning-rate", type=float, default=1e-2, help="Adam's; default: %(default)s")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank; default: %(default)s")
    p.add_argument("--seed", type=int, default=None, help="seed the adapter's initial weights: a repeatable run")
    return p.parse_args()


def make_datum(tokens: list[int]) -> types.Datum:
    """Predict token t+1 from tokens up to t."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], np.int64),
            "weights": np.ones(len(tokens) - 1, np.float32),
        },
    )


def main() -> None:
    args = parse_args()
    if not args.base_model:
        raise SystemExit("pass --base-model or set TINKER_BASE_MODEL")
    base_url = os.environ.get("TINKER_BASE_URL", "http://localhost:8000")
    # `with` finishes the session on exit: the server frees its adapter slot, the SDK stops its threads.
    with tinker.ServiceClient(base_url=base_url) as service:
        client = service.create_lora_training_client(
            base_model=args.base_model, rank=args.rank, seed=args.seed
        ).result()
        tokenizer = load_tokenizer(client, args.base_model, args.tokenizer)
        batch = [make_datum(tokenizer.encode(s, add_special_tokens=False)) for s in SENTENCES]
        n_tokens = sum(len(d.loss_fn_inputs["target_tokens"].tolist()) for d in batch)
        adam = types.AdamParams(learning_rate=args.learning_rate)
        for step in range(args.steps):
            result = client.forward_backward(batch, "cross_entropy").result()
            client.optim_step(adam).result()
            print(f"sl step {step:3d}  loss/token {result.metrics['loss:sum'] / n_tokens:.4f}", flush=True)
        path = client.save_weights_for_sampler("sl-final").result().path
        print(f"saved sampler weights: {path}", flush=True)


if __name__ == "__main__":
    main()
