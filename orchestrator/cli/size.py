"""`burstctl size`: the training-memory budget of a model, per term and per GPU, and which GPU sizes it fits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from orchestrator.app import App
from orchestrator.cli.base import FiniteFloat, cli, json_option, pass_app
from orchestrator.cli.output import out, print_json, table
from orchestrator.config import read_toml
from orchestrator.core.sizing import (
    COMMON_GPU_SIZES_GB,
    COMMON_GPUS,
    KV_CACHE_NAIVE_FORMULA,
    PRESETS,
    SizingEstimate,
    estimate,
    missing_architecture_fields,
)
from orchestrator.errors import BadInput, format_validation_error
from orchestrator.jobspec import ModelSpec

_POSITIVE_INT = click.IntRange(min=1)
_COUNT = click.IntRange(min=0)

# CLI option -> ModelSpec field; the flags are optional, ModelSpec holds the defaults.
_FLAG_FIELDS: dict[str, str] = {
    "preset": "preset",
    "params": "params",
    "layers": "layers",
    "hidden": "hidden_size",
    "heads": "attention_heads",
    "kv_heads": "kv_heads",
    "head_dim": "head_dim",
    "intermediate": "intermediate_size",
    "vocab": "vocab_size",
    "method": "method",
    "dtype": "dtype",
    "lora_rank": "lora_rank",
    "lora_targets": "lora_targets",
    "group_size": "group_size",
    "prompts": "prompts_per_step",
    "context": "context",
    "micro_batch": "micro_batch",
    "parallelism": "parallelism",
    "gradient_checkpointing": "gradient_checkpointing",
    "attention": "attention",
    "padding_mask": "padding_mask",
    "mixed_precision": "mixed_precision",
    "double_quant": "double_quant",
}

_TERM_MEANING: dict[str, str] = {
    "weights": "base weights in their dtype",
    "gradients": "trained parameters in their dtype (adapters: fp32)",
    "optimizer": "Adam state per trained parameter",
    "adapters": "LoRA adapter weights (fp32, as PEFT keeps them)",
    "activations": "kept for backward + output logits",
    "kv_cache": "GRPO rollout KV cache (grouped-query)",
}


@cli.command("size")
@click.option("--model", "preset", metavar="PRESET", help=f"Known architecture: {', '.join(sorted(PRESETS))}.")
@click.option("--job", "job_path", type=str, default=None,
              help="Size the [model] table of this job file instead (flags given as well override it).")
@click.option("--params", type=FiniteFloat(min=0, min_open=True), help="Parameter count, e.g. 7.6e9.")
@click.option("--layers", type=_POSITIVE_INT, help="Transformer layers.")
@click.option("--hidden", type=_POSITIVE_INT, help="Hidden size (model width).")
@click.option("--heads", type=_POSITIVE_INT, help="Query attention heads.")
@click.option("--kv-heads", type=_POSITIVE_INT, help="KV heads (grouped-query attention).")
@click.option("--head-dim", type=_POSITIVE_INT, help="Dimension per head (default hidden / heads).")
@click.option("--intermediate", type=_POSITIVE_INT, help="MLP intermediate size.")
@click.option("--vocab", type=_POSITIVE_INT, help="Vocabulary size (sizes the output logits).")
@click.option("--method", type=click.Choice(["full", "lora", "qlora"]), help="Fine-tuning method (default full).")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16", "int8", "int4"]),
              help="Weights dtype (default bf16; qlora means 4-bit base weights).")
@click.option("--lora-rank", type=_POSITIVE_INT, help="LoRA rank r (default 16).")
@click.option("--lora-targets", metavar="LIST",
              help="Comma-separated matrices, e.g. q_proj,k_proj,v_proj,o_proj (the default) or all-linear.")
@click.option("--group-size", type=_COUNT, help="GRPO group size G (0 = not GRPO).")
@click.option("--prompts", type=_COUNT, help="GRPO prompts per step.")
@click.option("--context", type=_POSITIVE_INT, help="Sequence / rollout context length (default 2048).")
@click.option("--micro-batch", type=_POSITIVE_INT, help="Micro-batch per GPU (default 1).")
@click.option("--gpus", type=click.IntRange(min=1, max=64), default=1, show_default=True,
              help="GPUs g (1 to 64, as a job file's gpus).")
@click.option("--parallelism", type=click.Choice(["ddp", "fsdp"]), help="ddp (replicated) | fsdp (sharded).")
@click.option("--gradient-checkpointing/--no-gradient-checkpointing", default=None,
              help="Recompute activations in the backward pass (default on).")
@click.option("--attention", type=click.Choice(["sdpa", "eager"]),
              help="sdpa (also flash; the default) | eager: each layer keeps heads × context² scores a sequence.")
@click.option("--padding-mask/--no-padding-mask", default=None,
              help="Sequences padded to a common length under an attention mask (default off: micro-batch 1 or "
                   "packed).")
@click.option("--mixed-precision/--no-mixed-precision", default=None,
              help="Full fine-tuning in bf16/fp16 with an fp32 master copy and fp32 Adam moments (default), or "
                   "trained in the dtype itself (8 B/param).")
@click.option("--double-quant/--no-double-quant", default=None,
              help="4-bit base weights with bitsandbytes' double quantization (0.516 B/param; default off: 0.5625).")
@json_option
@pass_app
def size_cmd(app: App, job_path: str | None, gpus: int, as_json: bool, **flags: Any) -> None:
    """Estimate training memory per term (GB = 10^9 bytes), per GPU, and which common GPU sizes fit."""
    model = _model_from(job_path, flags)
    # The margin gate 1 keeps on the local card, so `size` and the daemon give one verdict for a card.
    try:
        est = estimate(model, gpus, margin_gib=app.config.local.safety_margin_gib)
    except BadInput as exc:
        if job_path is not None or exc.field != "model.preset":
            raise
        raise BadInput(exc.detail, field="--model") from None  # the flag that named it, not the job file's field
    if as_json:
        print_json(est.to_json())
        return
    _print_human(est)


def _model_from(job_path: str | None, flags: dict[str, Any]) -> ModelSpec:
    base: dict[str, Any] = {}
    source = "command line"
    if job_path is not None:
        data = read_toml(Path(job_path))
        model_table = data.get("model")
        if not isinstance(model_table, dict):
            raise BadInput("has no [model] table to size", source=job_path, field="model")
        base = model_table
        source = job_path
    given = {_FLAG_FIELDS[k]: v for k, v in flags.items() if v is not None}
    if "lora_targets" in given:
        given["lora_targets"] = [t for t in given["lora_targets"].split(",") if t.strip()]
    try:
        model = ModelSpec.model_validate({**base, **given})
    except ValidationError as exc:
        raise format_validation_error(exc, source, ModelSpec) from None
    missing = missing_architecture_fields(model)
    if missing and job_path is None:
        # Name the flags the user can type rather than ModelSpec's field names.
        flag_of = {field: "--" + opt.replace("_", "-") for opt, field in _FLAG_FIELDS.items()}
        raise BadInput(f"give --model ({', '.join(sorted(PRESETS))}) or all of "
                       f"{', '.join(flag_of[m] for m in missing)}")
    return model


def _print_human(est: SizingEstimate) -> None:
    terms = est.terms
    # Rollout and training take turns: only the larger of the KV cache and the activations is in the total.
    aside = (min(("activations", "kv_cache"), key=lambda k: terms[k]) if terms["kv_cache"] > 0 else None)
    rows = [(k, f"{v:.2f}", _TERM_MEANING[k] + (" (not in the total: it takes turns with the "
                                                  f"{'KV cache' if k == 'activations' else 'activations'})"
                                                  if k == aside else "")) for k, v in terms.items()]
    peak = abs(sum(terms.values()) - est.total_gb) > 0.005
    rows.append(("total", f"{est.total_gb:.2f}", "one GPU, nothing sharded" + (": the peak, not the sum (the notes "
                                                                              "below say why)" if peak else "")))
    where = f"{est.gpus} GPU{'s' if est.gpus > 1 else ''}, {est.parallelism}"
    rows.append(("per GPU", f"{est.per_gpu_gb:.2f}", where))
    table("Training memory estimate", ["term", "GB", "what"], rows)
    marks = "  ".join(f"{s} GB {'yes' if est.fits[s] else 'no'}" for s in COMMON_GPU_SIZES_GB)
    out.print(f"Fits ({est.margin_gib:g} GiB of each card kept free, local.safety_margin_gib): {marks}")
    out.print("  each size as its card reads in nvidia-smi: " + ", ".join(
        f"{s} GB {card} {mib / 1024:.2f} GiB" for s, (card, mib) in COMMON_GPUS.items()))
    out.print(f"KV cache formula: {est.kv_cache_formula}")
    if est.terms["kv_cache"] > 0:
        out.print(f"  naive {KV_CACHE_NAIVE_FORMULA} = {est.kv_cache_naive_gb:.2f} GB, for comparison")
    for note in est.notes:
        out.print(f"- {note}")
