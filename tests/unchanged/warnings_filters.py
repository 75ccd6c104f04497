"""Warnings torch raises keep their category, message, module, file and line: filters keyed on
torch's module (a ``torch.tensor(t)`` copy warning reported by the ``torch.device`` context),
on the program's own module, ``simplefilter("always")`` (one warning per call), the default
once-per-location registry, ``catch_warnings(record=True)``, ``F.softmax`` without ``dim``
(a warning that must name this file and line), and a C++ warning (``.grad`` of a non-leaf).
"""

import warnings

import _observe as ob
import torch
import torch.nn.functional as F

ob.watch_warnings()
torch.manual_seed(0)


def neighbours(coords, rcut):
    with torch.device("cpu"):  # the default-device context is a TorchFunctionMode
        rc = torch.tensor(rcut)  # rcut is already a tensor: a copy, and a warning
        c = torch.tensor(coords, dtype=torch.float64)
        return (torch.cdist(c, c) < rc).sum(-1)


with ob.section("torch.tensor(t) under torch.device, default filters"):
    coords, rcut = torch.randn(16, 3), torch.tensor(1.2)
    for _ in range(3):  # shown once per location (the registry of the module it names)
        counts = neighbours(coords, rcut)
    print("counts", counts.tolist())

with ob.section("a filter keyed on torch's module turns the warning into an error"):
    with warnings.catch_warnings():
        ob.watch_warnings()
        warnings.filterwarnings(
            "error", message="To copy construct", module=r"torch\.utils\._device"
        )
        try:
            with torch.device("cpu"):
                torch.tensor(torch.ones(3))
            print("no exception")
        except UserWarning as err:
            print("raised UserWarning:", str(err)[:60])

with ob.section('simplefilter("always"): three calls, three warnings'):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        ob.watch_warnings()
        t = torch.arange(3.0)
        for _ in range(3):
            torch.tensor(t)

with ob.section("catch_warnings(record=True)"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.tensor(torch.zeros(2))
        F.softmax(torch.randn(2, 3))
        torch.randn(3, requires_grad=True).mul(2).grad  # noqa: B018 - warns: not a leaf
    for w in caught:
        print("recorded", ob.format_warning(w.message, w.category, w.filename, w.lineno))

with ob.section("softmax without dim names this line"):
    for _ in range(2):
        probs = F.softmax(torch.randn(2, 5))
    ob.show("probs", probs)
    # nn.Softmax() without dim: a known difference, pinned in test_unchanged.py

with ob.section("a filter keyed on the program's module"):
    with warnings.catch_warnings():
        ob.watch_warnings()
        warnings.filterwarnings("error", message="Implicit dimension", module="__main__")
        F.log_softmax(torch.ones(3, 3))

with ob.section("an explicit stacklevel warning from torch, and a C++ warning"):
    x = torch.randn(4, requires_grad=True)
    y = x * 3
    print("non-leaf grad", y.grad)
    with torch.cpu.amp.autocast():  # deprecated spelling: a FutureWarning
        pass
