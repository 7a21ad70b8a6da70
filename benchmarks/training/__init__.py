"""Training benchmarks: the training step of whole models (dense, LoRA / QLoRA, packed SFT), training attention
per mask and backend, and the kernel profile of a step (`step_profile`)."""
