"""A small PyTorch trainer on burstctl's job contract (docs/job-contract.md, "Writing a PyTorch trainer").

A char-level MLP (embedding, GELU, dropout) learns next-token prediction on a synthetic corpus with AdamW, a cosine
schedule and a shuffling DataLoader, on the CPU. A checkpoint (`state.pt` through burst_checkpoint.write_checkpoint)
holds the model, optimizer, scheduler, torch RNG, and the loader's position (its generator's state at the start of
the epoch and the next batch index), so a run resumed from $BURST_RESUME_FROM ends with every tensor and every
step's loss equal to an uninterrupted run's. SIGTERM: finish the step, checkpoint it, exit 143. Metrics:
`units_done` in $BURST_WORK_UNITS to $BURST_METRICS_FILE.

    PYTHONPATH=runbooks BURST_CHECKPOINT_DIR=ckpt python examples/torch_trainer.py --steps 300
"""
import argparse
import hashlib
import io
import json
import os
import signal
import sys
import time

import burst_checkpoint as bc  # on PYTHONPATH under the supervisor (docs/job-contract.md)
import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--ckpt-every", type=int, default=25)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--step-seconds", type=float, default=0.0)
p.add_argument("--out", default="result.json")
args = p.parse_args()

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
torch.manual_seed(args.seed)

# synthetic corpus: a noisy repeating grammar
VOCAB, CTX, BATCH = 27, 8, 64
g = torch.Generator().manual_seed(1000 + args.seed)
base = torch.randint(0, VOCAB, (97,), generator=g)
corpus = torch.cat([base[torch.randperm(97, generator=g)[:50]] for _ in range(200)])
X = torch.stack([corpus[i:i + CTX] for i in range(len(corpus) - CTX)])
Y = corpus[CTX:]
ds = torch.utils.data.TensorDataset(X, Y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.fc1 = nn.Linear(16 * CTX, 128)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(128, VOCAB)

    def forward(self, x):
        return self.fc2(self.drop(F.gelu(self.fc1(self.emb(x).flatten(1)))))


model = MLP()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
loader_gen = torch.Generator().manual_seed(args.seed)
loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True, generator=loader_gen, drop_last=True)

step, epoch, batch_in_epoch, losses = 0, 0, 0, []
ckpt_dir = os.environ.get("BURST_CHECKPOINT_DIR", "checkpoints")
resume = os.environ.get("BURST_RESUME_FROM", "")
if resume:
    if not bc.verify(resume):
        sys.exit(f"refusing to resume from {resume}: it does not verify")
    st = torch.load(os.path.join(resume, "state.pt"), weights_only=False)
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["opt"])
    sched.load_state_dict(st["sched"])
    torch.set_rng_state(st["torch_rng"])
    step, epoch, batch_in_epoch, losses = st["step"], st["epoch"], st["batch_in_epoch"], st["losses"]
    loader_gen.set_state(st["epoch_gen_state"])  # the generator state at the start of this epoch
    print(f"resumed from {resume} at step {step}", flush=True)

stop = False


def on_term(signum, frame):
    global stop
    stop = True


signal.signal(signal.SIGTERM, on_term)
work_units = float(os.environ.get("BURST_WORK_UNITS", "1"))
t0, step0 = time.time(), step


def save():
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
             "torch_rng": torch.get_rng_state(), "step": step, "epoch": epoch,
             "batch_in_epoch": batch_in_epoch, "epoch_gen_state": epoch_gen_state, "losses": losses}
    buf = io.BytesIO()
    torch.save(state, buf)
    bc.write_checkpoint(ckpt_dir, f"step-{step:08d}", {"state.pt": buf.getvalue()},
                        meta={"step": step, "seed": args.seed})
    bc.prune(ckpt_dir, keep=3)
    mf = os.environ.get("BURST_METRICS_FILE")
    if mf:
        el = time.time() - t0
        tp = (step - step0) / args.steps * work_units / (el / 3600) if el > 0 and step > step0 else None
        tmp = mf + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"units_done": step / args.steps * work_units, "throughput_units_h": tp, "step": step}, fh)
        os.replace(tmp, mf)


print(f"training from step {step} to {args.steps}", flush=True)
model.train()
last_saved = step
while step < args.steps and not stop:
    epoch_gen_state = loader_gen.get_state()
    for i, (x, y) in enumerate(loader):
        if i < batch_in_epoch:
            continue  # skip batches this epoch already trained on (resume mid-epoch)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        batch_in_epoch = i + 1
        losses.append(round(loss.item(), 6))
        if args.step_seconds:
            time.sleep(args.step_seconds)
        if step % args.ckpt_every == 0 or step == args.steps or stop:
            save()
            last_saved = step
        if step >= args.steps or stop:
            break
    else:
        epoch += 1
        batch_in_epoch = 0
        continue
    break

if stop:
    if last_saved != step:
        save()
    print(f"SIGTERM: checkpointed step {step}", flush=True)
    sys.exit(143)

h = hashlib.sha256()
for k, v in model.state_dict().items():
    h.update(k.encode())
    h.update(v.numpy().tobytes())
with open(args.out, "w") as fh:
    json.dump({"step": step, "final_loss": losses[-1], "model_sha256": h.hexdigest(), "losses_sha256":
               hashlib.sha256(json.dumps(losses).encode()).hexdigest()}, fh)
print(f"done: step {step} loss {losses[-1]:.4f}", flush=True)
