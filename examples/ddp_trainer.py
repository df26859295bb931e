"""A tiny deterministic data-parallel trainer (PyTorch DDP, gloo, CPU) that follows burstctl's job contract.

Launched by torchrun (a job with `gpus = 2` and `torchrun = true` runs `torchrun --nproc_per_node=2 ddp_trainer.py
...`), each worker reads RANK, WORLD_SIZE and LOCAL_RANK, joins a gloo process group and trains the same linear
model y = w.x + b (float64) on its own fixed shard of a data set generated from --seed, with SGD + momentum and a
cosine learning rate. DistributedDataParallel averages the gradients with a gloo all-reduce; with 2 ranks that sum
has one order (a + b = b + a exactly), and every mini-batch is drawn from a generator seeded by (seed, step, rank),
so a run resumed from a checkpoint takes exactly the same steps as an uninterrupted one: the final state is
bit-identical.

Contract (see docs/job-contract.md), as examples/trainer.py:
- rank 0 writes checkpoints `step-NNNNNNNN` (one file, `state.pt`: model, optimizer momentum, step) through
  burst_checkpoint.write_checkpoint into $BURST_CHECKPOINT_DIR; the other ranks wait for it at a barrier;
- every rank resumes from $BURST_RESUME_FROM (if set and not empty), after verifying it; a checkpoint that does not
  verify, or has another seed or world size, exits 2 (it never silently starts over);
- SIGTERM (torchrun forwards it to every worker): the ranks agree at the next step boundary to stop (an all-reduce
  of the flag, so all stop at the same step), rank 0 checkpoints that step (unless just saved), every rank exits 143;
- rank 0 writes progress to $BURST_METRICS_FILE and the final result to --out or result.json in the working directory,
  including what each worker saw of torchrun's environment (rank, local rank, world size, pid).

`burst_checkpoint` is found next to this file or on PYTHONPATH (how the daemon ships it to an instance), else in the
installed `runbooks` package, else in ../runbooks of a source checkout.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

EXIT_TERMINATED = 143  # 128 + SIGTERM, as examples/trainer.py
EXIT_BAD_RESUME = 2
SAMPLES = 1024  # split across the ranks: rank r gets samples r, r + world, r + 2·world, ...
FEATURES = 8
BATCH = 16  # per rank
MOMENTUM = 0.9
DTYPE = torch.float64


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


def make_shard(seed: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed shard of the data set (the whole set is generated identically on every rank)."""
    g = torch.Generator().manual_seed(seed)
    true_w = torch.rand(FEATURES, generator=g, dtype=DTYPE) * 4.0 - 2.0
    true_b = torch.rand(1, generator=g, dtype=DTYPE) * 2.0 - 1.0
    xs = torch.randn(SAMPLES, FEATURES, generator=g, dtype=DTYPE)
    ys = xs @ true_w + true_b + 0.1 * torch.randn(SAMPLES, generator=g, dtype=DTYPE)
    return xs[rank::world].contiguous(), ys[rank::world].contiguous()


def learning_rate(step: int, steps: int, base_lr: float) -> float:
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * (step - 1) / steps))


def state_hash(step: int, seed: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 over the exact bytes of the weights and momentum buffers (and step, seed): bit-identity, not closeness."""
    h = hashlib.sha256(f"{step}|{seed}".encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    for index, param in enumerate(model.parameters()):
        buf = opt.state.get(param, {}).get("momentum_buffer")
        h.update(f"momentum{index}".encode())
        if buf is not None:
            h.update(buf.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def write_json_atomic(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, sort_keys=True) + "\n")
    os.replace(str(tmp), str(path))


class DdpTrainer:
    def __init__(self, args: argparse.Namespace, ckpt: ModuleType) -> None:
        self.args = args
        self.ckpt = ckpt
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.ckpt_dir = Path(os.environ.get("BURST_CHECKPOINT_DIR") or "checkpoints")
        metrics = os.environ.get("BURST_METRICS_FILE")
        self.metrics_file = Path(metrics) if metrics and self.rank == 0 else None
        self.stop_requested = False
        self.started = time.monotonic()
        self.xs, self.ys = make_shard(args.seed, self.rank, self.world)
        self.net = torch.nn.Linear(FEATURES, 1, dtype=DTYPE)
        torch.nn.init.zeros_(self.net.weight)  # a fixed start, not one drawn from the global RNG
        torch.nn.init.zeros_(self.net.bias)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=args.lr, momentum=MOMENTUM)
        self.step = 0
        self.first_step = 0
        self.saved_step = -1

    def _on_sigterm(self, _signum: int, _frame: object) -> None:
        self.stop_requested = True  # acted on between steps, so the checkpoint is of a whole step

    def resume(self, path: str) -> None:
        if not self.ckpt.verify(path):
            raise ResumeError(f"BURST_RESUME_FROM={path} is not a complete checkpoint; refusing to resume from it")
        state = torch.load(Path(path) / "state.pt", weights_only=True)
        if state["seed"] != self.args.seed or state["world_size"] != self.world:
            raise ResumeError(f"checkpoint {path} has seed {state['seed']} and world size {state['world_size']}, "
                              f"this run --seed {self.args.seed} and world size {self.world}")
        self.net.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.step = self.first_step = self.saved_step = state["step"]
        if self.rank == 0:
            print(f"resumed from {path} at step {self.step}", flush=True)

    def save(self) -> None:
        """Rank 0 writes the checkpoint; every rank waits for it, so no rank runs (or exits) ahead of a write."""
        if self.rank == 0:
            name = f"step-{self.step:08d}"
            buf = io.BytesIO()
            torch.save({"step": self.step, "seed": self.args.seed, "world_size": self.world,
                        "model": self.net.state_dict(), "optimizer": self.opt.state_dict()}, buf)
            self.ckpt.write_checkpoint(self.ckpt_dir, name, {"state.pt": buf.getvalue()},
                                       meta={"step": self.step, "seed": self.args.seed, "steps": self.args.steps,
                                             "world_size": self.world})
            if self.args.keep > 0:
                self.ckpt.prune(self.ckpt_dir, keep=self.args.keep)
            print(f"checkpoint {name}", flush=True)
            self.report()
        self.saved_step = self.step
        dist.barrier()

    def report(self) -> None:
        if self.metrics_file is None:
            return
        hours = (time.monotonic() - self.started) / 3600.0
        done_here = (self.step - self.first_step) / self.args.steps
        write_json_atomic(self.metrics_file, {
            "step": self.step, "steps": self.args.steps, "units_done": self.step / self.args.steps,
            "throughput_units_h": done_here / hours if hours > 0 else None, "world_size": self.world,
        })

    def train_step(self, model: DistributedDataParallel) -> float:
        step = self.step + 1
        g = torch.Generator().manual_seed(self.args.seed * 1_000_003 + step * 1_009 + self.rank)
        batch = torch.randperm(len(self.xs), generator=g)[:BATCH]
        loss = ((model(self.xs[batch]).squeeze(1) - self.ys[batch]) ** 2).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces (averages) the gradients across the ranks here
        for group in self.opt.param_groups:
            group["lr"] = learning_rate(step, self.args.steps, self.args.lr)
        self.opt.step()
        self.step = step
        return float(loss.item())

    def agreed_stop(self) -> bool:
        """True on every rank once any rank got SIGTERM: all stop at the same step boundary."""
        flag = torch.tensor([1 if self.stop_requested else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

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
                print(f"ddp_trainer: error: rank {self.rank}: {exc}", file=sys.stderr)
                return EXIT_BAD_RESUME
        # DDP broadcasts rank 0's parameters at construction: identical here anyway (zeros, or the same checkpoint).
        model = DistributedDataParallel(self.net)
        args = self.args
        if self.rank == 0:
            print(f"training from step {self.step} to {args.steps} on {self.world} ranks", flush=True)
        loss = float("nan")
        while self.step < args.steps and not self.agreed_stop():
            loss = self.train_step(model)
            if self.step % args.checkpoint_every == 0:
                self.save()
            self.sleep(args.step_seconds)
        if self.step < args.steps:  # stopped by SIGTERM: keep the work done so far
            if self.saved_step != self.step:
                self.save()
            if self.rank == 0:
                print(f"stopped by SIGTERM at step {self.step}", flush=True)
            return EXIT_TERMINATED
        if self.saved_step != self.step:
            self.save()
        seen = {"rank": self.rank, "local_rank": self.local_rank, "pid": os.getpid(),
                "env_world_size": os.environ.get("WORLD_SIZE"), "env_rank": os.environ.get("RANK")}
        workers: list[Any] = [None] * self.world
        dist.all_gather_object(workers, seen)
        loss_t = torch.tensor([loss], dtype=DTYPE)
        dist.all_reduce(loss_t)  # the mean of the ranks' last batch losses: a + b in one order, as the gradients
        if self.rank == 0:
            out = Path(args.out or "result.json")  # the working directory, the job's workdir, where outputs are read
            write_json_atomic(out, {
                "step": self.step, "steps": args.steps, "seed": args.seed, "world_size": self.world,
                "workers": workers, "w": self.net.weight.detach().flatten().tolist(),
                "b": float(self.net.bias.item()), "last_batch_loss": float(loss_t.item()) / self.world,
                "state_sha256": state_hash(self.step, args.seed, self.net, self.opt),
            })
            print(f"done: step {self.step}, result in {out}", flush=True)
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Deterministic DDP linear-regression trainer (burstctl example).")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step, so a demo run takes a while")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--keep", type=int, default=3, help="complete checkpoints kept on disk (0 = all)")
    p.add_argument("--out", default="", help="result.json path (default: result.json in the working directory)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.checkpoint_every < 1 or args.step_seconds < 0 or args.keep < 0:
        p.error("--steps and --checkpoint-every must be >= 1, --step-seconds and --keep >= 0")
    if "RANK" not in os.environ:
        p.error("run me under torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR, ...), "
                "e.g. torchrun --nproc_per_node=2 ddp_trainer.py")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one thread per rank: the ranks share the machine's cores
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    try:
        return DdpTrainer(args, load_checkpoint_lib()).run()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
