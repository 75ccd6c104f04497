"""The framework callbacks, each with the real library on a tiny model built from a config
(nothing downloaded). Skipped where the optional extra is not installed."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from _require import require_module

import copytrace
from copytrace.dashboards import load_trace

STEPS = 3


def _one_run(out):
    trace = load_trace(out)
    assert len(trace.runs) == 1
    return trace.runs[0]


# --- PyTorch Lightning ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lightning():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        require_module("pytorch_lightning")
        return require_module("copytrace.integrations.lightning")


def _fit(lightning, callback, root):
    pl = lightning.pl
    config = {"d_in": 4, "d_hidden": 8, "lr": 0.1}

    class Tiny(pl.LightningModule):
        def __init__(self, cfg):
            super().__init__()
            self.cfg = cfg
            self.net = torch.nn.Sequential(
                torch.nn.Linear(cfg["d_in"], cfg["d_hidden"]),
                torch.nn.ReLU(),
                torch.nn.Linear(cfg["d_hidden"], 1),
            )

        def training_step(self, batch, idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.last = loss.detach().clone()  # a copy the trace must see
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.cfg["lr"])

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    )
    trainer = pl.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
        default_root_dir=str(root),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tiny(config), torch.utils.data.DataLoader(data, batch_size=4))


def test_lightning_callback_traces_fit_and_writes_report(lightning, tmp_path):
    out = tmp_path / "ct"
    cb = lightning.CopytraceCallback(out)
    _fit(lightning, cb, tmp_path)
    assert cb.report_path == out / "report.html" and cb.report_path.is_file()
    run = _one_run(out)
    assert run.resource["process.pid"] == os.getpid()
    assert len(run.steps) >= STEPS  # one step per training batch (+ the closing one)
    ops = [e.op for e in run.events]
    assert ops.count("clone") >= STEPS and "detach" in ops


def test_lightning_callback_joins_an_active_trace(lightning, tmp_path):
    # Under COPYTRACE=1 or copytrace run the process is already traced: the callback marks
    # steps in that trace and leaves the files and the report to it.
    with copytrace.trace(tmp_path / "outer") as outer:
        cb = lightning.CopytraceCallback(tmp_path / "inner")
        _fit(lightning, cb, tmp_path)
        assert outer.stats["steps"] >= STEPS
    assert not (tmp_path / "inner").exists() and cb.report_path is None
    assert len(list((tmp_path / "outer").glob("copytrace-*.otlp.jsonl*"))) == 1


# --- Hugging Face transformers ---------------------------------------------------------------------
def test_hf_trainer_callback_traces_training_and_writes_report(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        require_module("transformers")
        hf = require_module("copytrace.integrations.hf")
        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(8):
        ids = torch.randint(0, 32, (8,), generator=g)
        data.append({"input_ids": ids, "labels": ids.clone()})
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=STEPS, per_device_train_batch_size=2,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    out = tmp_path / "ct"
    cb = hf.CopytraceTrainerCallback(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    assert cb.report_path == out / "report.html" and cb.report_path.is_file()
    run = _one_run(out)
    assert len(run.steps) == STEPS + 1  # a boundary at each optimizer step, then the tail
    assert any(e.op == "to" for e in run.events)  # the Trainer moves each batch to the device
