"""Generation benchmarks: `tigon.generate` against Hugging Face `generate` (decode latency, time to first token),
the decode kernels against cuBLAS, the prefill's host time, and the profiles behind them."""
