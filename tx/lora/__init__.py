"""Multi-adapter LoRA: stacked slot parameters, the adapter kernels, PEFT import/export and merging."""
