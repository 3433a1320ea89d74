import torch


def compile_if_cuda(fn):
    """torch.compile `fn` when modules are being built on CUDA; elsewhere keep it plain,
    since compiling on a CPU costs more start-up time than it saves."""
    if torch.get_default_device().type == "cuda":
        return torch.compile(fn)
    return fn
