"""Decode benchmark: HF generate (eager, static + compile) against tigon.generate (graph and eager), batch 1 and 8,
on the anchors' 1.5B Llama config, plus Mistral sliding window 1024 with a 4096-token prompt.

    PYTHONPATH=src:benchmarks python3 benchmarks/bench_decode.py --out $OUT [--variants ...] [--batches 1,8]
        [--prompt 512] [--new 256] [--budget S] [--quick] [--prometheus FILE]

The method and the code live in tigon.bench_decode (so `tigon bench decode` runs it from an installed package);
this file is the benchmarks/ entry point.
"""

import sys

from tigon.bench_decode import main

if __name__ == "__main__":
    sys.exit(main())
