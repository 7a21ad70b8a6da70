"""SwiGLU / GeGLU (placeholder until the kernel lands)."""


def swiglu(gate, up):
    raise NotImplementedError


def geglu(gate, up):
    raise NotImplementedError
