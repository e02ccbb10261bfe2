"""`hyrax train-demo`: train the demo checkpoint on the recall task (CPU, minutes)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster.arg_types import non_negative_int, positive_float, positive_int


def add_parser(sub) -> argparse.ArgumentParser:
    from hyrax.tasks.train import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train-demo", help="train the demo checkpoint on the synthetic recall task (CPU)",
                       description="Train a small full + sliding + mamba2 model on the key-value recall task "
                                   "and write an HF-format checkpoint, tokenizer and loss curve. "
                                   "`--out hyrax/models/demo` reproduces the shipped checkpoint.")
    p.add_argument("--steps", type=positive_int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--out", default="demo-model", help="output directory (default ./demo-model)")
    p.add_argument("--seed", type=int, default=d.seed, help=f"initialisation and data seed (default {d.seed})")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size)
    p.add_argument("--lr", type=positive_float, default=d.lr)
    p.add_argument("--threads", type=positive_int, default=d.threads, help=f"torch threads (default {d.threads})")
    p.add_argument("--eval-n", type=non_negative_int, default=200,
                   help="held-out problems decoded greedily by the engine after training (0: skip)")
    p.set_defaults(func=run)
    return p


def run(a: argparse.Namespace) -> int:
    from hyrax.tasks.train import TrainConfig, train

    tc = TrainConfig(steps=a.steps, seed=a.seed, batch_size=a.batch_size, lr=a.lr, threads=a.threads)
    out = Path(a.out)
    try:  # fail now, not after half an hour of training
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".hyrax-write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise HyraxInputError(f"cannot write to --out {str(out)!r}: {e.strerror or e}") from None
    summary = train(out, tc, log=lambda s: print(s, file=sys.stderr))
    if a.eval_n > 0:
        from hyrax.actors.engine.config import EngineConfig
        from hyrax.tasks import recall
        from hyrax.tasks.evaluate import run_in_process

        problems = recall.heldout(a.eval_n)
        completions, _, _ = run_in_process(out, problems, EngineConfig(deterministic=True))
        summary["heldout"] = recall.score(problems, completions)
    print(json.dumps(summary, indent=2))
    print(f"hyrax: wrote {out}/ (config.json, model.safetensors, tokenizer, loss_curve.png)", file=sys.stderr)
    return 0
