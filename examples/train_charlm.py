"""Train a tiny character-level transformer language model on CPython's own help text.

This is an ordinary PyTorch training script with no download and no dependency beyond
torch: the corpus is the English text of ``pydoc_data.topics.topics`` (the topics behind
``help("if")`` and friends), which ships with every CPython. It does not import copytrace;
it is written the way people write training loops, including the usual tensor copy and
alias idioms (``.to(device)``, ``loss.detach()``, ``.item()``, ``copy.deepcopy`` of the
state dict and of the model, an in-place EMA update, ``.clone()``, ``.cpu()``), so that
copytrace has something realistic to trace. One hazard is deliberate and marked as such
(``torch.tensor(loss)`` every step), so that ``copytrace.analysis`` has one to report.

Run it plainly (``CHARLM_STEPS=N`` in the environment changes the default of ``--steps``,
400; stdout is the same on every run, the elapsed times go to stderr)::

    python examples/train_charlm.py [--steps N] [--eval-every K] [--seed S]

or traced by copytrace from outside (its step counter advances on each
``optimizer.step()``)::

    copytrace run examples/train_charlm.py
    COPYTRACE=1 python examples/train_charlm.py
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from pydoc_data.topics import topics

import torch
import torch.nn as nn
import torch.nn.functional as F

D_MODEL = 64
N_HEADS = 4
N_LAYERS = 2
CONTEXT = 64
BATCH = 16
LR = 3e-3
EMA_DECAY = 0.99
EVAL_BATCHES = 8


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, H, T, C/H): view + transpose are aliases, not copies.
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # Idiom: .contiguous() after transpose, so that .view() can merge the heads again.
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, D_MODEL)
        self.pos = nn.Embedding(CONTEXT, D_MODEL)
        self.blocks = nn.Sequential(*(Block(D_MODEL, N_HEADS) for _ in range(N_LAYERS)))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        return self.head(self.ln_f(self.blocks(x)))


def load_corpus() -> tuple[torch.Tensor, list[str]]:
    text = "\n".join(topics[key] for key in sorted(topics))
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    data = torch.tensor([stoi[ch] for ch in text], dtype=torch.long)
    return data, chars


def get_batch(data: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(len(data) - CONTEXT - 1, (BATCH,), generator=gen)
    x = torch.stack([data[s : s + CONTEXT] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + CONTEXT] for s in starts.tolist()])
    return x, y


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> tuple[float, float]:
    """Mean validation loss and next-character accuracy at the last position."""
    model.eval()
    losses = []
    correct = 0
    for xb, yb in batches:
        # Idiom: move each batch to the device (a no-op alias when device is the CPU).
        xb, yb = xb.to(device), yb.to(device)
        logits = model(xb)
        losses.append(F.cross_entropy(logits.view(-1, logits.shape[-1]), yb.view(-1)))
        # Idiom: clone the last-position logits to keep them for logging independently
        # of the full logits buffer.
        last = logits[:, -1, :].clone()
        correct += int((last.argmax(-1) == yb[:, -1]).sum())
    model.train()
    # Idiom: bring the metric tensor back to the host before turning it into a float.
    mean_loss = torch.stack(losses).mean().cpu()
    return float(mean_loss), correct / (len(batches) * BATCH)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # CHARLM_STEPS shortens the run without changing the command line (the test of the
    # README's commands runs them verbatim on a short run).
    steps = int(os.environ.get("CHARLM_STEPS") or 400)
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between evals")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    data, chars = load_corpus()
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    gen = torch.Generator().manual_seed(args.seed)
    val_gen = torch.Generator().manual_seed(args.seed + 1)
    val_batches = [get_batch(val_data, val_gen) for _ in range(EVAL_BATCHES)]

    model = CharLM(len(chars)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"corpus: {len(data):,} chars, vocab {len(chars)}; model: {n_params:,} parameters; "
        f"device: {device}"
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)

    # Idiom: an exponential-moving-average copy of the model, made once with deepcopy
    # and then refreshed in place every step.
    ema_model = copy.deepcopy(model)
    ema_model.requires_grad_(False)

    best_val = math.inf
    best_state: dict[str, torch.Tensor] | None = None
    running: list[torch.Tensor] = []
    loss_curve: list[torch.Tensor] = []  # one loss per step, e.g. for a plot
    train_loss = val_loss = math.nan
    t0 = time.perf_counter()

    for step in range(1, args.steps + 1):
        xb, yb = get_batch(train_data, gen)
        # Idiom: move each batch to the device (a no-op alias when device is the CPU).
        xb, yb = xb.to(device), yb.to(device)

        logits = model(xb)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), yb.view(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

        # Idiom: keep a detached loss for the running average, so that the autograd
        # graph of this step is not kept alive.
        running.append(loss.detach())
        # DELIBERATE HAZARD, kept on purpose so that the copytrace report has one to show
        # (tensor-ctor-copy, see docs/hazards.md): torch.tensor(loss) copies the loss every
        # step, and torch warns about it; loss.detach() above is the cheap form.
        loss_curve.append(torch.tensor(loss))

        # Idiom: in-place EMA refresh under no_grad (copy_ for buffers, lerp_ for weights).
        with torch.no_grad():
            for ema_p, p in zip(ema_model.parameters(), model.parameters(), strict=True):
                ema_p.lerp_(p, 1.0 - EMA_DECAY)
            for ema_b, b in zip(ema_model.buffers(), model.buffers(), strict=True):
                ema_b.copy_(b)

        if step % args.eval_every == 0 or step == args.steps:
            # Idiom: .item() to log a Python float.
            train_loss = torch.stack(running).mean().item()
            running.clear()
            val_loss, val_acc = evaluate(model, val_batches, device)
            ema_loss, _ = evaluate(ema_model, val_batches, device)
            if val_loss < best_val:
                best_val = val_loss
                # Idiom: snapshot the best weights; deepcopy so later steps don't mutate them.
                best_state = copy.deepcopy(model.state_dict())
            print(
                f"step {step:5d}  train {train_loss:.4f}  val {val_loss:.4f}  "
                f"ema_val {ema_loss:.4f}  val_acc {val_acc:.3f}"
            )
            print(f"step {step:5d}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    if best_state is not None:
        model.load_state_dict(best_state)
        print(f"restored best model: val_loss={best_val:.4f}")
    print(f"final: step={args.steps} train_loss={train_loss:.4f} val_loss={val_loss:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
