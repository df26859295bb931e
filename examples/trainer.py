"""A tiny deterministic trainer that follows burstctl's job contract (plain Python 3.8+, no NumPy).

It fits a linear model y = w.x + b by SGD with momentum and a cosine learning-rate schedule on a data set generated
from a fixed seed. Every step's mini-batch is drawn from an RNG seeded by (seed, step), so a run resumed from a
checkpoint takes exactly the same steps as an uninterrupted one: the final state is bit-identical.

Contract (see docs/job-contract.md):
- checkpoints go through burst_checkpoint.write_checkpoint into $BURST_CHECKPOINT_DIR as `step-NNNNNNNN`;
- $BURST_RESUME_FROM (if set and not empty) names the checkpoint to resume from; it is verified first and the
  trainer refuses (exit 2) to resume from a checkpoint that does not verify;
- SIGTERM: finish the current step, write a checkpoint at it (after --stop-seconds), exit 143;
- progress goes to $BURST_METRICS_FILE; the final result to --out or result.json in the working directory.

`burst_checkpoint` is found next to this file or on PYTHONPATH (how the daemon ships it to an instance), else in the
installed `runbooks` package, else in ../runbooks of a source checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import signal
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import IO

EXIT_TERMINATED = 143  # 128 + SIGTERM: what a shell reports for a job that stopped on SIGTERM
SAMPLES = 512
FEATURES = 8
BATCH = 32
MOMENTUM = 0.9


class ResumeError(Exception):
    """The checkpoint named to resume from cannot be used; starting over silently would hide lost work."""


def load_checkpoint_lib() -> ModuleType:
    try:
        import burst_checkpoint
        return burst_checkpoint
    except ImportError:
        pass
    try:
        from runbooks import burst_checkpoint
        return burst_checkpoint
    except ImportError:
        pass
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "runbooks"))
    import burst_checkpoint
    return burst_checkpoint


def dot(a: list[float], b: list[float]) -> float:
    # Indexing, not zip(): zip(strict=) needs Python 3.10 and the instance may have 3.8.
    return sum(a[i] * b[i] for i in range(len(a)))


def make_data(seed: int) -> tuple[list[list[float]], list[float]]:
    rng = random.Random(seed)
    true_w = [rng.uniform(-2.0, 2.0) for _ in range(FEATURES)]
    true_b = rng.uniform(-1.0, 1.0)
    xs = [[rng.gauss(0.0, 1.0) for _ in range(FEATURES)] for _ in range(SAMPLES)]
    ys = [dot(true_w, row) + true_b + rng.gauss(0.0, 0.1) for row in xs]
    return xs, ys


def fresh_state(seed: int) -> dict:
    return {"step": 0, "seed": seed, "w": [0.0] * FEATURES, "b": 0.0, "v_w": [0.0] * FEATURES, "v_b": 0.0}


def learning_rate(step: int, steps: int, base_lr: float) -> float:
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * (step - 1) / steps))


def sgd_step(state: dict, xs: list[list[float]], ys: list[float], steps: int, base_lr: float) -> float:
    """One step in place; returns the batch loss (mean squared error)."""
    step = state["step"] + 1
    batch = random.Random(state["seed"] * 1_000_003 + step).sample(range(SAMPLES), BATCH)
    grad_w = [0.0] * FEATURES
    grad_b = 0.0
    loss = 0.0
    for i in batch:
        err = dot(state["w"], xs[i]) + state["b"] - ys[i]
        loss += err * err
        for j in range(FEATURES):
            grad_w[j] += 2.0 * err * xs[i][j] / BATCH
        grad_b += 2.0 * err / BATCH
    lr = learning_rate(step, steps, base_lr)
    state["v_w"] = [MOMENTUM * state["v_w"][j] + grad_w[j] for j in range(FEATURES)]
    state["v_b"] = MOMENTUM * state["v_b"] + grad_b
    state["w"] = [state["w"][j] - lr * state["v_w"][j] for j in range(FEATURES)]
    state["b"] = state["b"] - lr * state["v_b"]
    state["step"] = step
    return loss / BATCH


def state_hash(state: dict) -> str:
    """sha256 over the exact bits of every number in the state (float.hex is lossless)."""
    floats = [*state["w"], state["b"], *state["v_w"], state["v_b"]]
    text = f"{state['step']}|{state['seed']}|" + "|".join(float(x).hex() for x in floats)
    return hashlib.sha256(text.encode()).hexdigest()


def shard_bytes(state: dict, mib: int) -> bytes:
    """A stand-in for a model shard of `mib` MiB: a function of the state (so a resumed run writes the same bytes as
    an uninterrupted one) that differs at every step (so every checkpoint really crosses the wire)."""
    return hashlib.sha256(state_hash(state).encode()).digest() * (mib * 32768)  # 32 B × 32768 = 1 MiB


def write_json_atomic(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, sort_keys=True) + "\n")
    os.replace(str(tmp), str(path))


class Trainer:
    def __init__(self, args: argparse.Namespace, ckpt: ModuleType) -> None:
        self.args = args
        self.ckpt = ckpt
        self.ckpt_dir = Path(os.environ.get("BURST_CHECKPOINT_DIR") or "checkpoints")
        metrics = os.environ.get("BURST_METRICS_FILE")
        self.metrics_file = Path(metrics) if metrics else None
        self.stop_requested = False
        self.started = time.monotonic()
        self.first_step = 0
        self.xs, self.ys = make_data(args.seed)
        self.state = fresh_state(args.seed)
        self.saved_step = -1

    def _on_sigterm(self, _signum: int, _frame: object) -> None:
        self.stop_requested = True  # acted on between steps, so the checkpoint is of a whole step

    def resume(self, path: str) -> None:
        if not self.ckpt.verify(path):
            raise ResumeError(f"BURST_RESUME_FROM={path} is not a complete checkpoint; refusing to resume from it")
        state = json.loads((Path(path) / "state.json").read_text())
        if state["seed"] != self.args.seed:
            raise ResumeError(f"checkpoint {path} has seed {state['seed']}, this run --seed {self.args.seed}")
        self.state = state
        self.first_step = self.saved_step = state["step"]
        print(f"resumed from {path} at step {state['step']}", flush=True)

    def save(self) -> None:
        step = self.state["step"]
        name = f"step-{step:08d}"
        files = {"state.json": json.dumps(self.state).encode()}
        if self.args.shard_mib > 0:
            files["shard.bin"] = shard_bytes(self.state, self.args.shard_mib)
        self.ckpt.write_checkpoint(self.ckpt_dir, name, files,
                                   meta={"step": step, "seed": self.args.seed, "steps": self.args.steps})
        self.saved_step = step
        if self.args.keep > 0:
            self.ckpt.prune(self.ckpt_dir, keep=self.args.keep)
        print(f"checkpoint {name}", flush=True)

    def report(self) -> None:
        if self.metrics_file is None:
            return
        hours = (time.monotonic() - self.started) / 3600.0
        # In the job's work units (W, from its job file), so the daemon can compare them with s_L, s_R and W.
        units = float(os.environ.get("BURST_WORK_UNITS") or 1.0)
        done_here = units * (self.state["step"] - self.first_step) / self.args.steps
        metrics = {
            "step": self.state["step"], "steps": self.args.steps,
            "units_done": units * self.state["step"] / self.args.steps,
            "throughput_units_h": done_here / hours if hours > 0 else None,
        }
        write_json_atomic(self.metrics_file, metrics)

    def run_log(self) -> IO[str]:
        """--log-dir's file of this run (a file of its own per run, as TensorBoard writes an events file per run)."""
        Path(self.args.log_dir).mkdir(parents=True, exist_ok=True)
        return open(Path(self.args.log_dir) / f"run-attempt{os.environ.get('BURST_ATTEMPT') or 0}.jsonl", "a")

    def sleep(self, seconds: float) -> None:
        # In slices, so SIGTERM is acted on promptly even with long simulated steps.
        end = time.monotonic() + seconds
        while not self.stop_requested and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        resume_from = os.environ.get("BURST_RESUME_FROM", "")
        if resume_from:
            try:
                self.resume(resume_from)
            except ResumeError as exc:
                print(f"trainer: error: {exc}", file=sys.stderr)
                return 2
        args = self.args
        print(f"training from step {self.state['step']} to {args.steps}", flush=True)  # SIGTERM handled from here
        loss = float("nan")
        with contextlib.ExitStack() as closing:
            log = closing.enter_context(self.run_log()) if args.log_dir else None
            while self.state["step"] < args.steps and not self.stop_requested:
                loss = sgd_step(self.state, self.xs, self.ys, args.steps, args.lr)
                if log is not None:
                    log.write(json.dumps({"step": self.state["step"], "loss": loss}) + "\n")
                    log.flush()
                if self.state["step"] % args.checkpoint_every == 0:
                    self.save()
                    self.report()
                if self.state["step"] == args.fail_at_step:
                    print(f"trainer: error: a planted bug at step {args.fail_at_step} (--fail-at-step)",
                          file=sys.stderr)
                    return 1
                self.sleep(args.step_seconds)
        if self.state["step"] < args.steps:  # stopped by SIGTERM: keep the work done so far
            time.sleep(args.stop_seconds)  # not in slices: a big model's last state leaving the GPU is not cut short
            if self.saved_step != self.state["step"]:
                self.save()
            self.report()
            print(f"stopped by SIGTERM at step {self.state['step']}", flush=True)
            return EXIT_TERMINATED
        if self.saved_step != self.state["step"]:
            self.save()
        self.report()
        # In the working directory, the job's workdir, where `outputs` are read from: beside the checkpoint dir it
        # was shared by every local job (<state>/checkpoints/) and out of the outputs' reach on an instance.
        out = Path(args.out or "result.json")
        write_json_atomic(out, {"step": self.state["step"], "steps": args.steps, "seed": args.seed,
                                "w": self.state["w"], "b": self.state["b"], "last_batch_loss": loss,
                                "state_sha256": state_hash(self.state)})
        print(f"done: step {self.state['step']}, result in {out}", flush=True)
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Deterministic linear-regression trainer (burstctl example).")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step, so a demo run takes a while")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--keep", type=int, default=3, help="complete checkpoints kept on disk (0 = all)")
    p.add_argument("--shard-mib", type=int, default=0,
                   help="also write a shard.bin of this many MiB per checkpoint, like a model's weights")
    p.add_argument("--stop-seconds", type=float, default=0.0,
                   help="on SIGTERM, this long before the last checkpoint is written (a large model's takes a while)")
    p.add_argument("--fail-at-step", type=int, default=0,
                   help="exit 1 on reaching this step, after its checkpoint if one falls due (a bug, to try "
                        "`burstctl retry`); 0: never")
    p.add_argument("--out", default="", help="result.json path (default: result.json in the working directory)")
    p.add_argument("--log-dir", default="", help="write a line per step (step, loss) to a file of this run's own "
                   "in this directory, run-attempt<N>.jsonl (N: $BURST_ATTEMPT), as TensorBoard writes one per run")
    args = p.parse_args(argv)
    if args.steps < 1 or args.checkpoint_every < 1 or min(args.step_seconds, args.stop_seconds, args.keep,
                                                           args.shard_mib) < 0:
        p.error("--steps and --checkpoint-every must be >= 1; --step-seconds, --stop-seconds, --keep and --shard-mib "
                ">= 0")
    return Trainer(args, load_checkpoint_lib()).run()


if __name__ == "__main__":
    sys.exit(main())
