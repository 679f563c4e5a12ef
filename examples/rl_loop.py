"""Reinforcement learning with the plain `tinker` SDK: sample, score, importance-sampling update.

Toy task: the reward of a completion is the fraction of its tokens that are plain words (letters
only, after stripping spaces). A randomly initialised model scores a little above one half; the
policy gradient pushes it up within a few steps. Runs unchanged against SmolGym or any Tinker service:
    TINKER_BASE_URL=http://localhost:8000 TINKER_API_KEY=tml-local python examples/rl_loop.py --base-model DIR
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import tinker
from loop_tokenizer import load_tokenizer
from tinker import types


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-model", default=os.environ.get("TINKER_BASE_MODEL"), help="default: $TINKER_BASE_MODEL")
    p.add_argument(
        "--tokenizer", help="a tokenizer directory or hub name (default: the server's; needed for an upload:NAME model)"
    )
    p.add_argument("--steps", type=int, default=12, help="default: %(default)s")
    p.add_argument("--learning-rate", type=float, default=5e-2, help="Adam's; default: %(default)s")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank; default: %(default)s")
    p.add_argument("--group-size", type=int, default=8, help="completions sampled per step; default: %(default)s")
    p.add_argument(
        "--seed", type=int, default=None, help="seed the adapter and the sampling (step i: seed + i): a repeatable run"
    )
    return p.parse_args()


def word_token_ids(tokenizer) -> set[int]:
    """Token ids whose text is letters only (a leading space allowed): the tokens we reward."""
    return {i for i in range(len(tokenizer)) if tokenizer.decode([i]).strip().isalpha()}


def make_datum(prompt: list[int], seq: types.SampledSequence, advantage: float) -> types.Datum:
    """Importance-sampling datum: sampler logprobs and the advantage on the generated positions only."""
    tokens = prompt + list(seq.tokens)
    n, start = len(tokens) - 1, len(prompt) - 1
    logprobs = np.zeros(n, np.float32)
    logprobs[start:] = seq.logprobs
    advantages = np.zeros(n, np.float32)
    advantages[start:] = advantage
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], np.int64),
            "logprobs": logprobs,
            "advantages": advantages,
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
        targets = word_token_ids(tokenizer)
        prompt = tokenizer.encode("Say a word:", add_special_tokens=False)
        adam = types.AdamParams(learning_rate=args.learning_rate)
        for step in range(args.steps):
            seed = None if args.seed is None else args.seed + step
            params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=seed)
            sampler = client.save_weights_and_get_sampling_client().result()
            result = sampler.sample(
                types.ModelInput.from_ints(prompt), num_samples=args.group_size, sampling_params=params
            ).result()
            rewards = [
                float(np.mean([t in targets for t in seq.tokens])) if seq.tokens else 0.0 for seq in result.sequences
            ]
            mean = float(np.mean(rewards))
            data = [
                make_datum(prompt, seq, r - mean)
                for seq, r in zip(result.sequences, rewards, strict=True)
                if seq.tokens
            ]
            client.forward_backward(data, "importance_sampling").result()
            client.optim_step(adam).result()
            sample = tokenizer.decode(list(result.sequences[0].tokens))
            print(f"rl step {step:3d}  mean reward {mean:.3f}  sample {sample!r}", flush=True)


if __name__ == "__main__":
    main()
