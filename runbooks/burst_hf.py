"""A Hugging Face `Trainer` (transformers, and TRL's trainers built on it) on burstctl's job contract: one callback.

    from burst_hf import BurstCallback, resume_from     # on PYTHONPATH under the supervisor, like burst_checkpoint

    burst = BurstCallback()
    trainer = Trainer(model=model, args=TrainingArguments(output_dir="out", save_steps=200, ...),
                      train_dataset=data, callbacks=[burst])
    trainer.train(resume_from_checkpoint=resume_from())
    burst.exit_if_stopped()                              # exit 143 when SIGTERM stopped it

- Every checkpoint the Trainer saves (each `save_steps`, and one more on SIGTERM) is published into
  $BURST_CHECKPOINT_DIR as a complete checkpoint, `step-<global step, 8 digits>`: the Trainer's own folder
  (weights, optimizer, scheduler, RNG states, trainer_state.json) hard-linked (copied across file systems) beside a
  manifest written last (`burst_checkpoint.write_checkpoint`), so a half-saved folder is never resumed from. The
  newest `keep` (3) are kept; the Trainer's own `output_dir/checkpoint-*` folders are left to its `save_total_limit`.
- SIGTERM (the supervisor forwards it: a spot notice, a switch of market, `revert-local`): the step under way
  finishes, the Trainer saves, training stops and `exit_if_stopped()` exits 143. Nothing is saved from inside the
  signal handler (it may fire in the middle of the optimizer's step).
- $BURST_METRICS_FILE gets `units_done` (global step / max steps × $BURST_WORK_UNITS) at every step's end, so the
  daemon sees progress between checkpoints.
- `resume_from()` is $BURST_RESUME_FROM, or None on a first start: the Trainer restores the model, optimizer,
  scheduler, RNG states and its place in the data from it, so the run carries on as if never stopped.

Outside the supervisor (no $BURST_CHECKPOINT_DIR) the callback publishes nothing and the Trainer runs as it would
without it. Needs transformers (imported here, not by burstctl).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

if TYPE_CHECKING or __package__:  # imported as runbooks.burst_hf (and by mypy, which checks the package)
    from . import burst_checkpoint as bc
else:  # a trainer's `import burst_hf`: beside burst_checkpoint.py on PYTHONPATH
    import burst_checkpoint as bc

STOPPED_EXIT = 143  # 128 + SIGTERM: what the supervisor reads as "stopped on request, checkpoint written"


def resume_from() -> str | None:
    """The checkpoint to resume from ($BURST_RESUME_FROM), or None on a first start: for
    `trainer.train(resume_from_checkpoint=...)`."""
    return os.environ.get("BURST_RESUME_FROM") or None


class BurstCallback(TrainerCallback):
    """Publishes the Trainer's checkpoints to burstctl, stops on SIGTERM after a last one, reports progress."""

    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self.stopped = False
        self.checkpoint_dir = os.environ.get("BURST_CHECKPOINT_DIR") or None
        self.metrics_file = os.environ.get("BURST_METRICS_FILE") or None
        self.work_units = float(os.environ.get("BURST_WORK_UNITS") or 1.0)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, _signum: int, _frame: Any) -> None:
        self.stopped = True  # acted on at the step's end: the Trainer is mid-step now

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> Any:
        self._report(state)
        if self.stopped:
            control.should_save = True
            control.should_training_stop = True
        return self._before_save(args, state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **_: Any) -> Any:
        return self._before_save(args, state, control)

    def _before_save(self, args: Any, state: Any, control: Any) -> Any:
        """The Trainer is about to save (its own flow callback, called first, has decided): a folder of that step
        left in `output_dir` by an earlier run (resumed from an older checkpoint) goes first. The Trainer writes into
        it in place, and its files are the published checkpoint's, hard-linked: written through, they would no
        longer match that checkpoint's manifest."""
        folder = _trainer_folder(args, state)
        if control.should_save and self.checkpoint_dir is not None and state.is_world_process_zero and folder.is_dir():
            shutil.rmtree(folder)
        return control

    def on_save(self, args: Any, state: Any, control: Any, **_: Any) -> Any:
        folder = _trainer_folder(args, state)
        # Under torchrun every rank is told; the folder is whole once the main one is (the Trainer waits for all).
        if self.checkpoint_dir is not None and state.is_world_process_zero and folder.is_dir():
            bc.write_checkpoint(self.checkpoint_dir, f"step-{state.global_step:08d}",
                                writer=lambda tmp: _link_tree(folder, tmp),
                                meta={"step": state.global_step, "max_steps": state.max_steps})
            bc.prune(self.checkpoint_dir, keep=self.keep, deep=False)
        return control

    def exit_if_stopped(self) -> None:
        """Exit 143 if SIGTERM stopped the training (its last checkpoint is published): call after `train()`."""
        if self.stopped:
            sys.exit(STOPPED_EXIT)

    def _report(self, state: Any) -> None:
        step, max_steps = state.global_step, state.max_steps
        if self.metrics_file is None or max_steps <= 0 or not state.is_world_process_zero:
            return
        tmp = f"{self.metrics_file}.tmp"
        with open(tmp, "w") as fh:
            json.dump({"units_done": min(step / max_steps, 1.0) * self.work_units, "step": step}, fh)
        os.replace(tmp, self.metrics_file)


def _trainer_folder(args: Any, state: Any) -> Path:
    """Where the Trainer saves (or has saved) the checkpoint of the step it is at."""
    return Path(args.output_dir) / f"checkpoint-{state.global_step}"


def _link_tree(src: Path, dest: Path) -> None:
    """`src`'s files under `dest`, hard-linked where the file system allows (a multi-GB checkpoint costs no copy),
    else copied."""
    for path in sorted(src.rglob("*")):
        target = dest / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)
