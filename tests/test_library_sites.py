"""The library's call site beside the user's line: recorded per event (the innermost frame of
an installed package other than torch), grouped by in ``copytrace summary`` / ``report``
(``--group-by library|user``), named by hazards; and autocast's recasts with its weight
cache off, which the `via` exclusion hid from redundant-copy.

The library here is a real package written into a ``site-packages`` folder of the test's own
(imported from there, as pip would install it); the HF Trainer and Lightning tests run the
real libraries on tiny models built from configs (nothing downloaded)."""

from __future__ import annotations

import importlib
import sys
import textwrap
import warnings

import pytest
import torch
from _require import require_module

import copytrace
from copytrace.analysis import analyze
from copytrace.cli import main

_LIB = '''
import copy
import torch

def prepare(batch):
    return batch.to(torch.float64)  # line 6

def snapshot(model):
    return copy.deepcopy(model.state_dict())  # line 9

from dataclasses import dataclass

@dataclass
class Holder:  # its __init__ is compiled from a string, in this module's globals
    x: torch.Tensor

    def __post_init__(self):
        self.x = self.x.clone()  # line 18
'''


@pytest.fixture()
def fakelib(tmp_path, monkeypatch):
    """A package ``ctfakelib`` installed into ``tmp_path/site-packages``."""
    pkg = tmp_path / "site-packages" / "ctfakelib"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(_LIB))
    monkeypatch.syspath_prepend(str(pkg.parent))
    sys.modules.pop("ctfakelib", None)
    yield importlib.import_module("ctfakelib")
    sys.modules.pop("ctfakelib", None)


def _train_with(lib, out, observer="auto"):
    model = torch.nn.Linear(4, 2)
    with copytrace.trace(out, observer=observer) as t:
        for _ in range(5):
            batch = lib.prepare(torch.randn(2, 4))  # the user's line for prepare
            lib.snapshot(model)  # the user's line for snapshot
            batch.clone()
            t.step()
    return t


@pytest.mark.parametrize("observer", ["auto", "python"])
def test_events_name_the_library_and_the_user_line(fakelib, tmp_path, observer):
    t = _train_with(fakelib, tmp_path / "ct", observer)
    lib_file = fakelib.__file__
    to = [e for e in t.events if e.op == "to"]
    assert len(to) >= 4
    for e in to:
        assert (e.lib_file, e.lib_line, e.lib_function) == (lib_file, 6, "prepare")
        assert e.file == __file__ and e.function == "_train_with" and e.via == "prepare"
    groups = [e for e in t.events if e.group]
    assert len(groups) >= 4
    assert {(e.lib_line, e.lib_function) for e in groups} == {(9, "snapshot")}
    clones = [e for e in t.events if e.op == "clone" and e.parent == -1]
    assert clones and all(e.lib_file is None for e in clones)  # the user called torch
    # the deepcopy-in-loop finding names the user's line first, then the library's
    found = [f for f in analyze(t.events) if f.code == "deepcopy-in-loop"]
    assert len(found) == 1
    user, lib = found[0].call_sites
    assert user.startswith(f"{__file__}:") and user.endswith(" _train_with")
    assert lib == f"{lib_file}:9 snapshot"


@pytest.mark.parametrize("observer", ["auto", "python"])
def test_a_library_dataclass_is_the_library(fakelib, observer):
    # Holder(x) runs dataclasses' generated __init__ (file "<string>", globals of ctfakelib),
    # which calls __post_init__: both are the library's; the user's line is this test's
    x = torch.randn(3)
    with copytrace.trace(write=False, observer=observer) as t:
        fakelib.Holder(x)
    line = sys._getframe(0).f_lineno - 1
    (e,) = [e for e in t.events if e.op == "clone"]
    assert (e.file, e.line) == (__file__, line)
    assert (e.lib_file, e.lib_line, e.lib_function) == (fakelib.__file__, 18,
                                                        "Holder.__post_init__")


def test_summary_groups_by_library_or_user(fakelib, tmp_path, capsys):
    out = tmp_path / "ct"
    _train_with(fakelib, out)
    assert main(["summary", str(out), "--no-analysis"]) == 0
    text = capsys.readouterr().out
    top = text.split("top call sites by bytes copied:")[1].split("\n\n")[0].strip()
    # the library's lines are the rows, the user's line beside them ("user's line" column)
    assert "user's line" in top.splitlines()[0]
    assert "ctfakelib/__init__.py:6 prepare" in top
    assert "ctfakelib/__init__.py:9 snapshot" in top
    row = next(r for r in top.splitlines() if "__init__.py:6 prepare" in r)
    assert "test_library_sites.py:" in row and "_train_with" in row
    assert main(["summary", str(out), "--no-analysis", "--group-by", "user"]) == 0
    top = capsys.readouterr().out.split("top call sites by bytes copied:")[1].split("\n\n")[0].strip()
    assert "library site" in top.splitlines()[0]
    rows = [r for r in top.splitlines()[2:] if r.strip()]
    assert all("test_library_sites.py:" in r.split("|")[0] for r in rows)  # user's lines
    assert any("ctfakelib/__init__.py:6 prepare" in r for r in rows)  # beside them


def test_parquet_export_has_the_library_columns(fakelib, tmp_path):
    import duckdb

    out = tmp_path / "ct"
    _train_with(fakelib, out)
    pq = tmp_path / "events.parquet"
    assert main(["export", str(out), "--parquet", str(pq)]) == 0
    rows = duckdb.sql(
        "SELECT lib_function, lib_line, function, count(*) FROM read_parquet(?) "
        "WHERE lib_file IS NOT NULL AND NOT \"group\" GROUP BY ALL ORDER BY 1", params=[str(pq)]
    ).fetchall()
    # the 5 .to(float64) of prepare (line 6) and the deepcopies' children in snapshot (9)
    assert [r[:3] for r in rows] == [("prepare", 6, "_train_with"), ("snapshot", 9, "_train_with")]
    assert rows[0][3] >= 4


def test_group_by_is_checked_before_reading(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        main(["summary", str(tmp_path), "--group-by", "module"])
    assert err.value.code == 2
    assert "--group-by" in capsys.readouterr().err


# --- autocast's recasts with its cache off ---------------------------------------------------
def _autocast_steps(cache_enabled: bool, micro: int = 3, steps: int = 2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with copytrace.trace(write=False) as t:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache_enabled):
                for _ in range(micro):
                    model(torch.randn(4, 8)).float().sum().backward()  # the user's line
            opt.step()
            opt.zero_grad()
    return t


def test_autocast_recasts_with_the_cache_off_are_redundant():
    t = _autocast_steps(cache_enabled=False)
    recasts = [f for f in analyze(t.events) if f.code == "redundant-copy"
               and "cache_enabled=False" in f.message]  # fmt: skip
    assert len(recasts) == 1
    f = recasts[0]
    # 4 parameters (2 weights, 2 biases) cast 3 times (one per micro-batch) in each of the
    # 2 steps: 4 x (3 - 1) x 2 = 16 extra casts
    assert "4 weights" in f.message and "up to 3 times in a step" in f.message
    assert "16 extra casts" in f.message
    assert f.call_sites[0].endswith(" _autocast_steps")
    assert len(f.steps) == 2


def test_autocast_with_its_cache_on_is_no_recast():
    # near miss: the same program with autocast's weight cache on (the default) casts each
    # parameter once per region: nothing to report
    t = _autocast_steps(cache_enabled=True)
    casts = [e for e in t.events if e.op == "implicit" and e.phase == "forward"
             and e.dtype == "bfloat16" and e.src_dtype == "float32"]  # fmt: skip
    assert len({(e.step, e.src_storage) for e in casts}) == len(casts)  # once per step each
    assert not [f for f in analyze(t.events) if f.code == "redundant-copy"]


# --- the real libraries ----------------------------------------------------------------------
def _library_rows(out, capsys, package: str) -> list[str]:
    assert main(["summary", str(out), "--no-analysis", "--top", "50"]) == 0
    text = capsys.readouterr().out
    top = text.split("top call sites by bytes copied:")[1].split("\n\n")[0].strip()
    return [r for r in top.splitlines() if f"{package}/" in r]


def test_hf_trainer_copies_are_placed_in_transformers_and_accelerate(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        require_module("transformers")
        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, 32, (8,), generator=g)), "labels": ids.clone()}
            for _ in range(8)]  # fmt: skip
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=2, per_device_train_batch_size=2,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    out = tmp_path / "ct"
    with warnings.catch_warnings(), copytrace.trace(out) as t:
        warnings.simplefilter("ignore")
        Trainer(model=model, args=args, train_dataset=data).train()  # the user's line
    user_line = sys._getframe(0).f_lineno - 1
    libs = {(e.lib_file, e.lib_line, e.lib_function) for e in t.events if e.lib_file}
    in_transformers = [s for s in libs if "/transformers/" in s[0]]
    assert in_transformers, "no copy placed inside transformers"
    for file, line, _ in in_transformers:  # real files and lines of the installed package
        assert 0 < line <= len(open(file).read().splitlines())
    # the batch moved to the device by the Trainer (Trainer._prepare_input) names it
    to = [e for e in t.events if e.op == "to" and e.lib_function]
    assert any("_prepare_input" in e.lib_function for e in to)
    assert all(e.file == __file__ for e in t.events if e.lib_file and e.file)
    assert any(e.line == user_line for e in t.events if e.lib_file)
    rows = _library_rows(out, capsys, "transformers")
    assert rows and any(f"test_library_sites.py:{user_line}" in r for r in rows)


def test_lightning_fit_copies_are_placed_in_lightning(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl = require_module("pytorch_lightning")

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4, generator=g),
                                          torch.randn(8, 1, generator=g))  # fmt: skip
    trainer = pl.Trainer(
        max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    out = tmp_path / "ct"
    with warnings.catch_warnings(), copytrace.trace(out) as t:
        warnings.simplefilter("ignore")
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))  # the user's line
    user_line = sys._getframe(0).f_lineno - 1
    package = pl.__name__.split(".")[0]  # pytorch_lightning (or lightning)
    placed = [e for e in t.events if e.lib_file and f"/{package}/" in e.lib_file]
    assert placed, "no copy placed inside Lightning"
    for e in placed:
        assert 0 < e.lib_line <= len(open(e.lib_file).read().splitlines())
        assert e.file == __file__
    assert any(e.line == user_line for e in placed)
    rows = _library_rows(out, capsys, package)
    assert rows and any(f"test_library_sites.py:{user_line}" in r for r in rows)
