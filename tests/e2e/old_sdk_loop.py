"""A minimal SL + sampling loop for an old tinker SDK (0.16.x: JSON bodies, no client/config; 0.2.x: no sessions).

Run by tests/e2e/test_old_sdk.py with that SDK's interpreter: `python old_sdk_loop.py URL BASE_MODEL`.
Prints one JSON line with what it saw; any failure is an exception (non-zero exit).
"""

import json
import sys

import numpy as np
import tinker
from tinker import types

url, base_model = sys.argv[1], sys.argv[2]
service = tinker.ServiceClient(base_url=url, api_key="tml-old-sdk")
client = service.create_lora_training_client(base_model=base_model, rank=4, seed=0)  # a repeatable run
tokens = [1, 2, 3, 4, 5, 6, 7, 8]
datum = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64), "weights": np.ones(7, np.float32)},
)
losses = []
for _ in range(4):
    losses.append(client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
forward = client.forward([datum], "cross_entropy").result().metrics["loss:sum"]
sampler = client.save_weights_and_get_sampling_client(name="old-sdk")
params = types.SamplingParams(max_tokens=4)
result = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), num_samples=2, sampling_params=params).result()
logprobs = sampler.compute_logprobs(types.ModelInput.from_ints([1, 2, 3])).result()
state = client.save_state("old-sdk-state").result().path
resumed = service.create_training_client_from_state(state)
print(
    json.dumps(
        {
            "losses": losses,
            "forward": forward,
            "samples": [list(s.tokens) for s in result.sequences],
            "prompt_logprobs": logprobs,
            "state": state,
            "resumed_model_id": resumed.model_id,
        }
    )
)
