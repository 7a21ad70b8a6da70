"""What the benchmarks share: the timing harness (`harness`), the results tables (`render_table`) and where the
checkout's folders are and how a benchmark starts a child process (`checkout`)."""
