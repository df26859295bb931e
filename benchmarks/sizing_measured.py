"""Gate 1's memory model (`orchestrator.core.sizing`) against what PyTorch actually keeps, on this CPU.

Run by hand, with a venv that has transformers (it is not a dependency of burstctl, and no test imports it):

    python3 -m venv /tmp/sizing-venv
    /tmp/sizing-venv/bin/pip install torch transformers peft  # the CPU build of torch is enough
    PYTHONPATH=. /tmp/sizing-venv/bin/python benchmarks/sizing_measured.py

Models are built from a config with random weights (no download): small Llama- and Qwen2-style decoders with
grouped-query attention (hidden 256, 4 layers, 8 heads, 2 KV heads, intermediate 688, vocab 1000), in bf16 and
fp32, with attn_implementation "sdpa" and "eager", with and without gradient checkpointing (non-reentrant). Every
parameter is trained (full fine-tuning) but in 2b. Three measurements, each printed as measured vs estimated and
their ratio:

1. Saved for backward: every tensor autograd saves during forward + loss (`torch.autograd.graph.saved_tensors_hooks`),
   each storage counted once at its storage's nbytes, parameters excluded. Split into the decoder layers (per token
   per layer, against `sizing.layer_activation_bytes_per_token`), the final norm + lm_head input, and the loss (per
   logit entry).
2. Peak: the most bytes alive at once during forward + loss + backward, from a `TorchDispatchMode` that sees every
   storage an op creates and a weakref finalizer for its release; parameters and the storages that end up as
   `.grad` (the estimate's `gradients` term) excluded. Against `sizing.activation_bytes`, the whole activations
   term. The logits' share of the peak (storages of at least one byte per logit entry) is measured on a model whose
   vocabulary dominates (hidden 64, 1 layer, vocab 32000), with the outputs dropped before backward (as
   transformers' Trainer does) and held through it (`out = model(...); out.loss.backward()`).
2b. LoRA through PEFT (r 16, q/k/v/o and all-linear), frozen base: saved per layer and peak against the estimate for
   `method = "lora"`; needs peft as well.
3. A GRPO-style step: `generate` G sequences (plain transformers generate, DynamicCache), then train on them. Peak
   during generate above the weights against `sizing.kv_cache_bytes`, what is left alive after generate returns,
   and whether the step's peak is the sum or the larger of the two.

Everything is counted in bytes of tensor storage, not allocator or process memory: the estimate's own unit.
"""

from __future__ import annotations

import argparse
import itertools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from orchestrator.core import sizing

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build(family: str, dtype: str, attn: str, *, hidden: int = 256, layers: int = 4, heads: int = 8,
          kv_heads: int = 2, intermediate: int = 688, vocab: int = 1000) -> tuple[torch.nn.Module, sizing.Architecture]:
    kw = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
              intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=8192,
              tie_word_embeddings=False, attn_implementation=attn)
    torch.manual_seed(0)
    model = (LlamaForCausalLM(LlamaConfig(**kw)) if family == "llama" else Qwen2ForCausalLM(Qwen2Config(**kw)))
    model = model.to(DTYPES[dtype]).train()
    params = sum(p.numel() for p in model.parameters())
    arch = sizing.Architecture(params=params, layers=layers, hidden_size=hidden, attention_heads=heads,
                               kv_heads=kv_heads, head_dim=hidden // heads, intermediate_size=intermediate,
                               vocab_size=vocab)
    return model, arch


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def param_keys(model: torch.nn.Module) -> set[int]:
    return {_key(t) for t in itertools.chain(model.parameters(), model.buffers())}


# --- 1. what autograd saves -------------------------------------------------------------------------------------


@dataclass
class Saved:
    layers: int  # bytes saved before the final norm (decoder layers, embedding indices, RoPE cos/sin)
    head: int  # the final norm and the lm_head's input
    loss: int  # after the lm_head: the loss's tensors


def _batch(ids: torch.Tensor, pad: int) -> dict[str, torch.Tensor]:
    """input_ids and labels, with an attention mask left-padding the first `pad` tokens when pad > 0."""
    batch = {"input_ids": ids, "labels": ids}
    if pad:
        mask = torch.ones_like(ids)
        mask[:, :pad] = 0
        batch["attention_mask"] = mask
    return batch


def saved_for_backward(model: torch.nn.Module, ids: torch.Tensor, pad: int = 0) -> Saved:
    """Bytes autograd keeps for backward after forward + loss, each storage once, parameters excluded."""
    exclude = param_keys(model)
    seen: dict[int, tuple[str, int]] = {}
    keep: list[torch.Tensor] = []  # hold every saved tensor so no storage is freed and its address reused
    section = ["layers"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = _key(t)
        if k not in exclude and k not in seen and t.untyped_storage().nbytes() > 0:
            seen[k] = (section[0], t.untyped_storage().nbytes())
            keep.append(t)
        return t

    lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model wraps the LM
    hooks = [lm.model.norm.register_forward_pre_hook(lambda *_: section.__setitem__(0, "head")),
             lm.lm_head.register_forward_hook(lambda *_: section.__setitem__(0, "loss"))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**_batch(ids, pad)).loss
    finally:
        for h in hooks:
            h.remove()
    del loss
    keep.clear()
    by = {"layers": 0, "head": 0, "loss": 0}
    for name, nbytes in seen.values():
        by[name] += nbytes
    return Saved(**by)


# --- 2. live bytes over time ------------------------------------------------------------------------------------


class LiveStorages(TorchDispatchMode):
    """Every storage an op outputs, from its creation to its release (weakref finalizer), as a timeline."""

    def __init__(self, preexisting: Iterator[torch.Tensor]) -> None:
        super().__init__()
        self.ids: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t in preexisting:
            self.ids[t.untyped_storage()] = -1
        self.counter = itertools.count()
        self.events: list[tuple[int, int]] = []  # (storage id, +bytes on creation / -bytes on release)
        self.nbytes: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st not in self.ids and st.nbytes() > 0:
                    sid = next(self.counter)
                    self.ids[st] = sid
                    self.nbytes[sid] = st.nbytes()
                    self.events.append((sid, st.nbytes()))
                    weakref.finalize(st, self.events.append, (sid, -st.nbytes()))
        return out

    def sid(self, t: torch.Tensor) -> int | None:
        return self.ids.get(t.untyped_storage())

    def peak(self, skip: set[int] = frozenset(), only: Callable[[int], bool] = lambda sid: True,
             upto: int | None = None) -> tuple[int, int]:
        """(peak bytes, event index of the peak) over storages not in `skip` and passing `only`."""
        live = best = at = 0
        for i, (sid, delta) in enumerate(self.events[:upto]):
            if sid in skip or not only(sid):
                continue
            live += delta
            if live > best:
                best, at = live, i
        return best, at

    def live_at(self, index: int, skip: set[int] = frozenset()) -> int:
        return sum(d for sid, d in self.events[:index] if sid not in skip)


def _preexisting(model: torch.nn.Module, *tensors: torch.Tensor) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()
    yield from tensors


def train_step_peak(model: torch.nn.Module, ids: torch.Tensor, hold_outputs: bool,
                    logits_entries: int | None = None, pad: int = 0) -> tuple[int, int]:
    """Peak live bytes (parameters and gradients excluded) over forward + loss + backward, and the logits' share at
    that moment (storages of at least one byte per logit entry) when `logits_entries` is given."""
    model.zero_grad(set_to_none=True)
    tracker = LiveStorages(_preexisting(model, ids))
    with tracker:
        if hold_outputs:
            out = model(**_batch(ids, pad))
            out.loss.backward()
            del out
        else:
            loss = model(**_batch(ids, pad)).loss
            loss.backward()
            del loss
    grads = {tracker.sid(p.grad) for p in model.parameters() if p.grad is not None}
    peak, at = tracker.peak(skip=grads)
    logits = 0
    if logits_entries:
        big = {sid for sid, n in tracker.nbytes.items() if n >= logits_entries}
        logits = sum(d for sid, d in tracker.events[:at + 1] if sid in big and sid not in grads)
    model.zero_grad(set_to_none=True)
    return peak, logits


# --- the cases --------------------------------------------------------------------------------------------------


def ratio(measured: float, estimated: float) -> str:
    return f"{measured / estimated:.2f}" if estimated else "-"


def activations_cases(tokens: int) -> None:
    print(f"\n## 1-2. Activations: saved for backward and peak, {tokens} tokens, micro-batch 1\n")
    print("| model | dtype | attention | ckpt | layer B/token, measured | estimated | ratio "
          "| head B/token | loss saved B/logit | peak MB, measured | estimated | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for family, dtype, attn, ckpt in itertools.product(("llama", "qwen2"), ("bf16", "fp32"),
                                                        ("sdpa", "sdpa+pad", "eager", "eager+pad"),
                                                        (False, True)):
        model, arch = build(family, dtype, attn.removesuffix("+pad"))
        pad = 16 if attn.endswith("+pad") else 0
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        cb = 4.0 if dtype == "fp32" else 2.0
        ids = torch.randint(0, arch.vocab_size or 1, (1, tokens))
        saved = saved_for_backward(model, ids, pad)
        per_layer = saved.layers / (arch.layers * tokens)
        kind = attn.removesuffix("+pad")
        est_layer = (arch.hidden_size * cb if ckpt
                     else sizing.layer_activation_bytes_per_token(arch, cb, kind, tokens, pad > 0))
        peak, _ = train_step_peak(model, ids, hold_outputs=False, pad=pad)
        est_peak = sizing.activation_bytes(arch, 1, tokens, cb, ckpt, kind, pad > 0)
        print(f"| {family} | {dtype} | {attn} | {'on' if ckpt else 'off'} | {per_layer:.0f} | {est_layer:.0f} "
              f"| {ratio(per_layer, est_layer)} | {saved.head / tokens:.0f} "
              f"| {saved.loss / (tokens * (arch.vocab_size or 1)):.2f} | {peak / 1e6:.2f} | {est_peak / 1e6:.2f} "
              f"| {ratio(peak, est_peak)} |")


def lora_cases(tokens: int) -> None:
    """LoRA through PEFT (r 16, no dropout) on a frozen base: what the layers keep and the peak, against the
    estimate for `method = "lora"` with the same targets."""
    from peft import LoraConfig, get_peft_model

    print(f"\n## 1-2b. LoRA (PEFT, r 16): saved for backward and peak, {tokens} tokens, micro-batch 1, sdpa\n")
    print("| model | dtype | targets | ckpt | layer B/token, measured | estimated | ratio | head B/token "
          "| peak MB, measured | estimated | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for family, dtype, targets, ckpt in itertools.product(
            ("llama", "qwen2"), ("bf16", "fp32"), (("q_proj", "k_proj", "v_proj", "o_proj"), sizing.LORA_TARGETS),
            (False, True)):
        base, arch = build(family, dtype, "sdpa")
        if ckpt:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base.enable_input_require_grads()  # a frozen embedding: the checkpointed layers' inputs need grad
        model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(targets)))
        model.train()
        cb = 4.0 if dtype == "fp32" else 2.0
        ids = torch.randint(0, arch.vocab_size or 1, (1, tokens))
        saved = saved_for_backward(model, ids)
        per_layer = saved.layers / (arch.layers * tokens)
        lora = sizing.LoraTraining(rank=16, targets=frozenset(targets))
        est_layer = (arch.hidden_size * cb if ckpt
                     else sizing.layer_activation_bytes_per_token(arch, cb, lora=lora))
        peak, _ = train_step_peak(model, ids, hold_outputs=False)
        est_peak = sizing.activation_bytes(arch, 1, tokens, cb, ckpt, lora=lora)
        names = "q,k,v,o" if len(targets) == 4 else "all-linear"
        print(f"| {family} | {dtype} | {names} | {'on' if ckpt else 'off'} | {per_layer:.0f} | {est_layer:.0f} "
              f"| {ratio(per_layer, est_layer)} | {saved.head / tokens:.0f} | {peak / 1e6:.2f} | {est_peak / 1e6:.2f} "
              f"| {ratio(peak, est_peak)} |")


def logits_cases(tokens: int) -> None:
    print(f"\n## 2. The logits at the peak: hidden 64, 1 layer, vocab 32000, {tokens} tokens, sdpa, no ckpt\n")
    print("| model | dtype | outputs | logits B/entry at the peak | estimated B/entry | ratio | peak MB | estimated "
          "| ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for family, dtype, hold in itertools.product(("llama", "qwen2"), ("bf16", "fp32"), (False, True)):
        model, arch = build(family, dtype, "sdpa", hidden=64, layers=1, heads=4, kv_heads=2, intermediate=172,
                            vocab=32000)
        cb = 4.0 if dtype == "fp32" else 2.0
        ids = torch.randint(0, 32000, (1, tokens))
        entries = tokens * 32000
        peak, logits = train_step_peak(model, ids, hold_outputs=hold, logits_entries=entries)
        est_entry = sizing.logits_bytes_per_entry(cb)
        est_peak = sizing.activation_bytes(arch, 1, tokens, cb, False)
        print(f"| {family} | {dtype} | {'held' if hold else 'dropped'} | {logits / entries:.2f} | {est_entry:g} "
              f"| {ratio(logits / entries, est_entry)} | {peak / 1e6:.1f} | {est_peak / 1e6:.1f} "
              f"| {ratio(peak, est_peak)} |")


def grpo_cases(group: int, prompt: int, new: int) -> None:
    print(f"\n## 3. GRPO-style step: generate {group} sequences ({prompt} prompt + {new} new tokens), then train\n")
    print("| model | dtype | generate peak MB | KV cache estimated | ratio | left after generate MB "
          "| train peak MB | step peak MB | sum of the two | larger of the two |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for family, dtype in itertools.product(("llama", "qwen2"), ("bf16", "fp32")):
        model, arch = build(family, dtype, "sdpa")
        cb = 4.0 if dtype == "fp32" else 2.0
        prompts = torch.randint(0, 1000, (group, prompt))
        model.zero_grad(set_to_none=True)
        tracker = LiveStorages(_preexisting(model, prompts))
        with tracker:
            model.eval()
            with torch.no_grad():
                seqs = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False, pad_token_id=0)
            after_generate = len(tracker.events)
            model.train()
            loss = model(input_ids=seqs, labels=seqs).loss
            loss.backward()
            del loss
        grads = {tracker.sid(p.grad) for p in model.parameters() if p.grad is not None}
        gen_peak, _ = tracker.peak(skip=grads, upto=after_generate)
        left = tracker.live_at(after_generate, skip=grads)
        step_peak, _ = tracker.peak(skip=grads)
        # the training part alone: its events after generate, above what generate left alive
        live, train_peak = left, 0
        for sid, d in tracker.events[after_generate:]:
            if sid not in grads:
                live += d
                train_peak = max(train_peak, live - left)
        kv = sizing.kv_cache_bytes(arch, prompt + new, group, cb)
        print(f"| {family} | {dtype} | {gen_peak / 1e6:.2f} | {kv / 1e6:.2f} | {ratio(gen_peak, kv)} "
              f"| {left / 1e6:.2f} | {train_peak / 1e6:.2f} | {step_peak / 1e6:.2f} "
              f"| {(gen_peak + train_peak) / 1e6:.2f} | {max(gen_peak, train_peak) / 1e6:.2f} |")
        model.zero_grad(set_to_none=True)


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="sequence length for the activation cases")
    parser.add_argument("--logit-tokens", type=int, default=1024, help="sequence length for the logits cases")
    parser.add_argument("--group", type=int, default=4, help="GRPO group size G")
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens (few: the cache dominates)")
    parser.add_argument("--new", type=int, default=248, help="tokens generated per sequence")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=("activations", "lora", "logits", "grpo"))
    args = parser.parse_args()
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} thread(s)")
    with _threads(args.threads):
        if args.only in (None, "activations"):
            activations_cases(args.tokens)
        if args.only in (None, "lora"):
            lora_cases(args.tokens)
        if args.only in (None, "logits"):
            logits_cases(args.logit_tokens)
        if args.only in (None, "grpo"):
            grpo_cases(args.group, args.prompt, args.new)


if __name__ == "__main__":
    main()
