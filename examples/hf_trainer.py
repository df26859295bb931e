"""A Hugging Face `Trainer` run on burstctl's job contract (docs/job-contract.md, "With the Hugging Face Trainer").

What a fine-tune needs beyond its usual script is three lines: `BurstCallback()` in the Trainer's callbacks,
`resume_from_checkpoint=resume_from()`, and `exit_if_stopped()` after `train()` (runbooks/burst_hf.py). The rest is
a stand-in for your own: a two-layer Llama built from its config (nothing to download) learning a synthetic corpus on
the CPU, with attention dropout, AdamW and a cosine schedule, so that a run stopped and resumed can be checked
against an uninterrupted one. `result.json` holds a hash of every weight's bytes, every step's loss and the last
step.

    PYTHONPATH=runbooks BURST_CHECKPOINT_DIR=ckpt python examples/hf_trainer.py --steps 40
"""

import argparse
import hashlib
import json
import time

import torch
from burst_hf import BurstCallback, resume_from  # on PYTHONPATH under the supervisor, beside burst_checkpoint
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--save-steps", type=int, default=5)
p.add_argument("--output-dir", default="hf-out", help="the Trainer's own output_dir")
p.add_argument("--out", default="result.json")
p.add_argument("--step-seconds", type=float, default=0.0, help="sleep after each step (tests: time to stop it)")
args = p.parse_args()

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)


class Corpus(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """64 sequences of 16 tokens, the same in every run."""

    def __init__(self) -> None:
        self.tokens = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class Pace(TrainerCallback):
    def on_step_end(self, *_args, **_kwargs):  # type: ignore[no-untyped-def]
        time.sleep(args.step_seconds)


torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                     attention_dropout=0.1))
training = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, save_steps=args.save_steps,
                             save_total_limit=2, per_device_train_batch_size=4, learning_rate=1e-3,
                             lr_scheduler_type="cosine", warmup_steps=3, logging_steps=1, report_to=[], use_cpu=True,
                             seed=0, data_seed=0, disable_tqdm=True)
burst = BurstCallback()
trainer = Trainer(model=model, args=training, train_dataset=Corpus(), callbacks=[burst, Pace()])
trainer.train(resume_from_checkpoint=resume_from())
burst.exit_if_stopped()  # SIGTERM: the last checkpoint is published, exit 143

digest = hashlib.sha256()
for name, tensor in sorted(trainer.model.state_dict().items()):
    digest.update(name.encode())
    digest.update(tensor.detach().cpu().numpy().tobytes())
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
with open(args.out, "w") as fh:
    json.dump({"model_sha256": digest.hexdigest(), "losses": losses, "step": trainer.state.global_step}, fh)
