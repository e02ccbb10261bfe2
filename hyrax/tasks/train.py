"""Train the demo checkpoint on the recall task (CPU, float32, a few minutes to half an hour).

The model trains through the serving forward itself: `HybridModel.forward` over a packed
batch with fresh, zeroed state pools (one page range and one Mamba slot per sequence), so
the weights that ship are exactly the weights the engine runs. Pools do not require grad;
writing K/V or Mamba state into them records the copy in the autograd graph, and gradients
flow back through the rows read again (checked in tests/tasks).

Reproducible: the seed fixes the initialisation and the stream of training problems.
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hyrax.actors.engine.pools import allocate_device_pools, pool_sizes
from hyrax.actors.model.batch import SeqSlice, build_forward_batch
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.demo import DEMO_CONFIG, EOS, write_tokenizer
from hyrax.actors.model.hybrid import HybridModel
from hyrax.actors.model.loader import save_model
from hyrax.tasks import recall

PAGE = 16


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2500
    batch_size: int = 32
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    min_pairs: int = 2  # training contexts hold min_pairs..MAX_PAIRS pairs: short ones are learnt first
    delay_ramp: float = 0.4  # share of the steps over which the delay line grows to its full length
    init_std: float = 0.1  # 0.02 sat on the "guess a digit" plateau for 1000+ steps in trials
    eval_every: int = 100
    eval_n: int = 128
    threads: int = 1  # one thread: the result is bit-reproducible and a second core stays free


def encode(p: recall.Problem) -> tuple[list[int], list[int]]:
    """Token ids of prompt + completion (delay line + value) + EOS, and the positions whose
    next token is scored (every completion token and the terminator)."""
    prompt = list(p.prompt.encode("utf-8"))
    ids = prompt + list(p.completion.encode("utf-8")) + [EOS]
    # a cut delay line (curriculum) starts with a letter the prompt does not determine:
    # that one is not scored
    first = len(prompt) - 1 if p.delay == len(recall.DELAY) else len(prompt)
    return ids, list(range(first, len(ids) - 1))


def forward_logits(model: HybridModel, seqs: list[list[int]]) -> torch.Tensor:
    """Logits at every position of right-padded sequences: (B, T, vocab).

    Runs the serving forward (one prefill step per sequence from position 0) on fresh pools.
    """
    comps = model.components
    T = max(len(s) for s in seqs)
    pages = -(-T // PAGE)
    sizes = pool_sizes(comps, PAGE, len(seqs) * pages * PAGE, len(seqs), len(seqs) * pages * PAGE)
    pools = allocate_device_pools(comps, sizes)
    slices = [
        SeqSlice(s, 0, {c.name: list(range(b * pages, (b + 1) * pages)) for c in comps if c.paged},
                 {c.name: b for c in comps if not c.paged})
        for b, s in enumerate(seqs)
    ]
    return model(build_forward_batch(slices, comps, PAGE), pools, all_logits=True)


def batch_tensors(problems: list[recall.Problem]) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Sequences, next-token targets (B, T) and the scored mask (B, T)."""
    enc = [encode(p) for p in problems]
    T = max(len(ids) for ids, _ in enc)
    targets = torch.zeros(len(enc), T, dtype=torch.long)
    mask = torch.zeros(len(enc), T, dtype=torch.bool)
    for b, (ids, scored) in enumerate(enc):
        for t in scored:
            targets[b, t] = ids[t + 1]
            mask[b, t] = True
    return [ids for ids, _ in enc], targets, mask


def loss_and_exact(model: HybridModel, problems: list[recall.Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over answer tokens, and per-problem exact match under teacher
    forcing (every answer token is the argmax — the same as greedy decoding getting it right)."""
    seqs, targets, mask = batch_tensors(problems)
    logits = forward_logits(model, seqs)
    ce = torch.nn.functional.cross_entropy(logits[mask], targets[mask])
    right = (logits.argmax(-1) == targets) | ~mask
    return ce, right.all(dim=1)


def init_weights(model: HybridModel, seed: int, std: float = 0.02) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1.0, 16.0)))
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1)))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif name.endswith(".D") or "norm" in name:
                p.fill_(1.0)
            elif "conv1d.weight" in name:
                p.normal_(0.0, 0.2)
            elif p.dim() >= 2:
                p.normal_(0.0, std)
            else:
                p.zero_()


def max_delay_at(step: int, tc: TrainConfig) -> int:
    """The curriculum: the longest delay line trained at `step` (full length after the ramp)."""
    ramp = tc.delay_ramp * tc.steps
    if ramp <= 0 or step >= ramp:
        return len(recall.DELAY)
    return int(len(recall.DELAY) * step / ramp)


def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    frac = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def _progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, file=sys.stderr, dynamic_ncols=True, desc="train")
    except ImportError:  # a plain stderr line instead
        class _Line:
            n = 0

            def update(self, k):
                self.n += k

            def set_postfix_str(self, s):
                print(f"\rtrain {self.n}/{total} {s}", end="", file=sys.stderr, flush=True)

            def close(self):
                print(file=sys.stderr)

        return _Line()


def evaluate_teacher_forced(model: HybridModel, problems: list[recall.Problem], batch: int = 64) -> float:
    ok = 0
    with torch.no_grad():
        for i in range(0, len(problems), batch):
            _, exact = loss_and_exact(model, problems[i: i + batch])
            ok += int(exact.sum())
    return ok / len(problems)


def train(out: Path, tc: TrainConfig, cfg: ModelConfig = DEMO_CONFIG, log=print) -> dict:
    """Train, save the checkpoint + tokenizer + loss curve into `out`; returns a summary."""
    torch.set_num_threads(tc.threads)
    model = HybridModel(cfg, dtype=torch.float32)
    init_weights(model, tc.seed, tc.init_std)
    model.requires_grad_(True)
    params = list(model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.98))
    rng = random.Random(f"train-stream:{tc.seed}")
    val = recall.generate("heldout", tc.eval_n, recall.HELDOUT_SEED + 1)  # a monitor set, not the eval set
    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    bar = _progress(tc.steps)
    t0 = time.perf_counter()
    for step in range(tc.steps):
        delay = max_delay_at(step, tc)
        problems = [recall.training_problem(rng, tc.min_pairs, delay) for _ in range(tc.batch_size)]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        loss, _ = loss_and_exact(model, problems)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        bar.update(1)
        if step % 10 == 0 or step == tc.steps - 1:
            recent = sum(losses[-20:]) / len(losses[-20:])
            bar.set_postfix_str(f"loss {recent:.4f} lr {lr_at(step, tc):.2e}")
        if (step + 1) % tc.eval_every == 0 or step == tc.steps - 1:
            acc = evaluate_teacher_forced(model, val)
            evals.append((step + 1, acc))
            log(f"step {step + 1}: loss {sum(losses[-50:]) / len(losses[-50:]):.4f} monitor exact-match {acc:.3f} "
                f"({time.perf_counter() - t0:.0f}s)")
    bar.close()
    elapsed = time.perf_counter() - t0
    model.requires_grad_(False)
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out)
    write_tokenizer(out)
    summary = {
        "train_config": asdict(tc), "seconds": round(elapsed, 1),
        "final_loss": sum(losses[-50:]) / len(losses[-50:]), "monitor_exact_match": evals[-1][1] if evals else None,
    }
    plot_losses(losses, evals, out / "loss_curve.png", summary)
    return summary


def plot_losses(losses: list[float], evals: list[tuple[int, float]], path: Path, summary: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("hyrax: matplotlib is not installed; no loss curve written (pip install matplotlib)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(range(1, len(losses) + 1), losses, lw=0.6, alpha=0.35, color="tab:blue", label="batch loss")
    k = 25
    if len(losses) >= k:
        smooth = [sum(losses[i - k + 1: i + 1]) / k for i in range(k - 1, len(losses))]
        ax.plot(range(k, len(losses) + 1), smooth, color="tab:blue", label=f"mean of {k}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy on answer tokens")
    ax.grid(alpha=0.3)
    if evals:
        ax2 = ax.twinx()
        ax2.plot([s for s, _ in evals], [a for _, a in evals], "o-", color="tab:orange", label="monitor exact-match")
        ax2.set_ylim(0, 1.02)
        ax2.set_ylabel("exact match (teacher-forced)")
        ax2.legend(loc="center right")
    ax.legend(loc="upper right")
    tc = summary["train_config"]
    ax.set_title(f"demo model: recall task, {tc['steps']} steps, batch {tc['batch_size']}, seed {tc['seed']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
