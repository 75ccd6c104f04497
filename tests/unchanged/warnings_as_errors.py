"""Run with ``python -W error``: a warning torch raises becomes an exception at the same place,
traced or not. Each part prints the exception and the frames of its traceback (file, line,
function); the last one is left uncaught, so the exit status and the final line of the
traceback take part too.
"""

import traceback

import _observe as ob
import torch

torch.manual_seed(0)


def frames(err):
    return [
        (ob.where(f.filename), f.lineno, f.name) for f in traceback.extract_tb(err.__traceback__)
    ]


def attempt(name, fn):
    with ob.section(name):
        try:
            fn()
            print("no exception")
        except Warning as err:
            print(f"raised {type(err).__name__}: {err}")
            print("frames", frames(err))


def copy_construct():
    t = torch.ones(3)
    return torch.tensor(t)  # a C++ warning raised as an exception: at this line


def under_device():
    with torch.device("cpu"):
        return torch.tensor(torch.ones(2))  # raised from torch's device mode


def checkpoint_no_grad():
    from torch.utils.checkpoint import checkpoint

    return checkpoint(torch.sin, torch.ones(2), use_reentrant=True)


attempt("torch.tensor(t)", copy_construct)
attempt("torch.tensor(t) under torch.device", under_device)
# F.softmax without dim under -W error: a known difference, pinned in test_unchanged.py
attempt("checkpoint without grad inputs", checkpoint_no_grad)
print("finally uncaught:", flush=True)
x = torch.arange(4.0)
y = torch.tensor(x)  # the program ends here with UserWarning, exit status 1
print("not reached", y)
