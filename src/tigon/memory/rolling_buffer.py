"""RollingBuffer workspace (placeholder until it lands)."""


class RollingBuffer:
    pass


def workspace(device):
    raise NotImplementedError
