"""Op benchmarks: each op against torch eager, torch.compile and the peer kernels on the one harness
(`benchmarks.tools.harness`), the op run of a GPU machine (`gpu_check`), and the launch-setting sweeps."""
