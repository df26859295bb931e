"""Memory sizing (gate 1's input) and `burstctl size`.

Reference figures: the seed chapter's budget for a 7.6 B-parameter model (weights 15.2 GB in bf16, gradients
15.2 GB, Adam ≈ 91 GB; its QLoRA base ≈ 4.2 GB quantizes every parameter, which bitsandbytes does not), and PEFT
`print_trainable_parameters()` outputs published for Qwen2.5-7B-Instruct (r=16 on q/k/v/o: 10,092,544 trainable
of 7,625,709,056) and Llama-3.1-8B (r=16 on all seven linear layers: 41,943,040 trainable of 8,072,204,288). Those
"all params" include the adapters, so the base counts are 7,615,616,512 and 8,030,261,248.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.core.sizing import (
    ADAM_BYTES_MIXED,
    COMMON_GPU_SIZES_GB,
    COMMON_GPUS,
    PRESETS,
    TERM_KEYS,
    LoraTraining,
    activation_bytes,
    count_params,
    estimate,
    fits_in,
    head_bytes_per_token,
    layer_activation_bytes_per_token,
    layer_backward_bytes_per_token,
    logits_bytes_per_entry,
    lora_adapter_params,
    rmsnorm_bytes_per_token,
)
from orchestrator.errors import BadInput
from orchestrator.jobspec import ModelSpec

QWEN7B = PRESETS["qwen2.5-7b"].arch


def _seed_model(**kw: object) -> ModelSpec:
    """The seed's example: the Qwen2.5-7B shapes with the seed's round 7.6 B parameters."""
    return ModelSpec(preset="qwen2.5-7b", params=7.6e9, **kw)


# --- the seed's budget -------------------------------------------------------------------------------------------


def test_full_bf16_reproduces_the_seed_budget_for_7_6b_parameters() -> None:
    terms = estimate(_seed_model(method="full", dtype="bf16")).terms
    assert terms["weights"] == pytest.approx(15.2)
    assert terms["gradients"] == pytest.approx(15.2)
    assert terms["optimizer"] == pytest.approx(91.2)  # 12 B × 7.6e9; the seed rounds to 91
    assert terms["adapters"] == 0.0


def test_qlora_quantizes_the_blocks_linear_layers_and_leaves_embeddings_lm_head_and_norms_16_bit() -> None:
    # bitsandbytes (transformers' get_keys_to_not_convert) keeps the input embedding and the lm_head unquantized;
    # the norms are not linear layers. Qwen2.5-7B: 2 × 152064 × 3584 embedding parameters, untied.
    est = estimate(ModelSpec(preset="qwen2.5-7b", method="qlora"))
    kept = 2 * 152064 * 3584 + 3584 * (2 * 28 + 1)
    # Each 4-bit weight is half a byte, and each block of 64 has an fp32 absmax (transformers' default: no double
    # quantization): 4.5 bits per parameter.
    assert est.terms["weights"] == pytest.approx(((QWEN7B.params - kept) * 0.5625 + kept * 2) / 1e9)
    assert est.terms["weights"] == pytest.approx(5.85, abs=0.01)  # not the seed's 4.2 (0.55 B × every parameter)
    # Double quantization keeps the absmax in 8 bits, with an fp32 constant per 256 blocks: the QLoRA paper's
    # 4.127 bits per parameter.
    double = estimate(ModelSpec(preset="qwen2.5-7b", method="qlora", double_quant=True))
    assert double.terms["weights"] == pytest.approx(((QWEN7B.params - kept) * 4.127 / 8 + kept * 2) / 1e9, rel=1e-4)
    assert "0.5159 B/param, with double quantization" in " ".join(double.notes)
    tied = estimate(ModelSpec(preset="qwen2.5-1.5b", method="qlora"))  # tied: one matrix for both
    arch = PRESETS["qwen2.5-1.5b"].arch
    kept_tied = arch.vocab_size * arch.hidden_size + arch.hidden_size * (2 * arch.layers + 1)
    assert tied.terms["weights"] == pytest.approx(((arch.params - kept_tied) * 0.5625 + kept_tied * 2) / 1e9)
    int8 = estimate(ModelSpec(preset="qwen2.5-7b", method="lora", dtype="int8"))
    assert int8.terms["weights"] == pytest.approx(((QWEN7B.params - kept) * 1 + kept * 2) / 1e9)


def test_lora_moves_gradients_and_adam_from_the_base_to_the_adapters() -> None:
    full = estimate(_seed_model(method="full"))
    lora = estimate(_seed_model(method="lora"))
    adapters = lora_adapter_params(QWEN7B, 16, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert lora.trained_params == adapters
    assert lora.terms["weights"] == full.terms["weights"]  # bf16 base, frozen but still resident
    # PEFT's adapters are fp32: fp32 gradients and two fp32 moments, no master copy; 16 B each, as AMP's would be.
    assert lora.terms["gradients"] == pytest.approx(adapters * 4 / 1e9)
    assert lora.terms["optimizer"] == pytest.approx(adapters * 8 / 1e9)
    assert lora.terms["adapters"] == pytest.approx(adapters * 4 / 1e9)
    assert sum(lora.terms[k] for k in ("gradients", "optimizer", "adapters")) == pytest.approx(
        adapters * (2 + 2 + ADAM_BYTES_MIXED) / 1e9)
    assert lora.terms["optimizer"] < 1.0 < full.terms["optimizer"]  # the seed: 91 GB collapses to well under 1 GB


def test_fp32_weights_need_no_separate_master_copy() -> None:
    terms = estimate(_seed_model(dtype="fp32")).terms
    assert terms["weights"] == pytest.approx(30.4)
    assert terms["gradients"] == pytest.approx(30.4)
    assert terms["optimizer"] == pytest.approx(60.8)  # two fp32 moments, 8 B/param


# --- presets and parameter counts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2.5-7b", "llama-3.1-8b", "qwen2.5-1.5b", "llama-3.2-1b"])
def test_preset_published_parameter_count_matches_its_shapes(name: str) -> None:
    preset = PRESETS[name]
    assert count_params(preset) == pytest.approx(preset.arch.params, rel=0.005)


def test_parameter_counts_match_peft_printouts() -> None:
    assert count_params(PRESETS["qwen2.5-7b"]) == 7_625_709_056 - 10_092_544
    assert count_params(PRESETS["llama-3.1-8b"]) == 8_072_204_288 - 41_943_040
    assert QWEN7B.params == 7.61e9


def test_lora_adapter_counts_match_peft_printouts() -> None:
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert lora_adapter_params(QWEN7B, 16, attention) == 10_092_544
    assert lora_adapter_params(PRESETS["llama-3.1-8b"].arch, 16, ["all-linear"]) == 41_943_040


def test_lora_uses_the_narrow_grouped_query_kv_shapes() -> None:
    # Qwen2.5-7B: q is 3584 -> 28·128 = 3584 wide, k is 3584 -> 4·128 = 512 wide.
    assert lora_adapter_params(QWEN7B, 8, ["q_proj"]) == 28 * 8 * (3584 + 3584)
    assert lora_adapter_params(QWEN7B, 8, ["k_proj"]) == 28 * 8 * (3584 + 512)
    assert lora_adapter_params(QWEN7B, 8, ["down_proj"]) == 28 * 8 * (18944 + 3584)


def test_an_explicit_architecture_sizes_like_the_preset_it_describes() -> None:
    explicit = ModelSpec(params=7.61e9, layers=28, hidden_size=3584, attention_heads=28, kv_heads=4,
                         intermediate_size=18944, vocab_size=152064, group_size=8, prompts_per_step=2)
    from_preset = ModelSpec(preset="qwen2.5-7b", group_size=8, prompts_per_step=2)
    assert estimate(explicit).terms == estimate(from_preset).terms


def test_preset_names_are_case_insensitive_and_overrides_are_noted() -> None:
    est = estimate(ModelSpec(preset="Qwen2.5-7B", params=7.6e9))
    assert est.params == 7.6e9
    assert any("override" in n and "params" in n for n in est.notes)


# --- activations and the rollout KV cache -------------------------------------------------------------------------


# The activation figures are what benchmarks/sizing_measured.py measured on transformers' Llama and Qwen2 (saved
# tensors and peak live storage, CPU, bf16 and fp32): the tests pin the formula those measurements confirmed.


def test_rmsnorm_keeps_an_fp32_copy_of_its_input_and_two_normalized_values() -> None:
    # bf16: the fp32 upcast of the input (4 B), 1/rms (4 B per token), normalized before and after the weight (2 × 2 B)
    assert rmsnorm_bytes_per_token(3584, 2.0) == 8 * 3584 + 4
    # fp32: the upcast is the input itself; three h-wide fp32 tensors
    assert rmsnorm_bytes_per_token(3584, 4.0) == 12 * 3584 + 4


def test_a_layer_keeps_two_norms_q_k_v_attention_output_and_four_mlp_tensors() -> None:
    h, q, kv, inter, heads = 3584, 28 * 128, 4 * 128, 18944, 28
    norms = 2 * (8 * h + 4)
    attention = 2 * (2 * q + 2 * kv) + 4 * heads  # q, k, v after RoPE (kv narrow), output; fp32 log-sum-exp per head
    mlp = 2 * 4 * inter  # gate, up, SiLU(gate), their product
    assert layer_activation_bytes_per_token(QWEN7B, 2.0) == norms + attention + mlp
    # The old count (norm inputs at the compute dtype, 4h + 2·q_dim + 2·kv_dim + 4·I elements) was 15 % low here.
    old = (4 * h + 2 * q + 2 * kv + 4 * inter) * 2
    assert layer_activation_bytes_per_token(QWEN7B, 2.0) / old == pytest.approx(1.146, abs=0.001)


def test_eager_attention_keeps_each_heads_softmax_and_its_copy_per_key_and_k_v_repeated_to_the_query_heads() -> None:
    q, kv, heads, ctx = 28 * 128, 4 * 128, 28, 4096
    sdpa = layer_activation_bytes_per_token(QWEN7B, 2.0)
    eager = layer_activation_bytes_per_token(QWEN7B, 2.0, "eager", ctx)
    # the fp32 softmax (4 B) and its bf16 copy (2 B) per head and key; no fused kernel's log-sum-exp
    assert eager - sdpa == heads * ctx * (4 + 2) + 2 * (2 * (q - kv)) - 4 * heads
    assert eager / sdpa == pytest.approx(4.11, abs=0.01)  # at 4096 tokens the softmax is three layers' worth
    # In fp32 the copy is the softmax itself.
    fp32 = layer_activation_bytes_per_token(QWEN7B, 4.0, "eager", ctx) - layer_activation_bytes_per_token(QWEN7B, 4.0)
    assert fp32 == heads * ctx * 4 + 4 * (2 * (q - kv)) - 4 * heads


def test_a_padding_mask_repeats_k_v_and_keeps_a_mask_per_layer_under_sdpa_but_adds_nothing_to_eager() -> None:
    q, kv, ctx = 28 * 128, 4 * 128, 1024
    plain = layer_activation_bytes_per_token(QWEN7B, 2.0, "sdpa", ctx)
    assert layer_activation_bytes_per_token(QWEN7B, 2.0, "sdpa", ctx, padding_mask=True) - plain \
        == 2 * (2 * (q - kv)) + 2 * ctx
    eager = layer_activation_bytes_per_token(QWEN7B, 2.0, "eager", ctx)
    assert layer_activation_bytes_per_token(QWEN7B, 2.0, "eager", ctx, padding_mask=True) == eager


def test_eager_attentions_backward_holds_the_gradients_of_the_softmax_once_the_mlp_has_let_go() -> None:
    q, inter, heads, ctx = 28 * 128, 18944, 28, 4096
    mlp = layer_backward_bytes_per_token(QWEN7B, 2.0)
    assert mlp == 2 * 2 * inter
    scores = heads * ctx * (2 + 4) + 2 * 3 * q - 2 * 4 * inter  # after the MLP's saved tensors are freed
    assert layer_backward_bytes_per_token(QWEN7B, 2.0, "eager", ctx) == max(mlp, scores) == scores
    assert layer_backward_bytes_per_token(QWEN7B, 2.0, "eager", 128) == mlp  # short context: the MLP's is larger
    # Without a vocabulary, with checkpointing, the recomputed eager layer and its backward are the top of the peak.
    no_vocab = replace(QWEN7B, vocab_size=None)
    layer = layer_activation_bytes_per_token(QWEN7B, 2.0, "eager", ctx)
    assert activation_bytes(no_vocab, 1, ctx, 2.0, True, "eager") == ctx * (28 * 3584 * 2 + layer + scores)


def test_without_checkpointing_eager_attention_at_long_context_dwarfs_the_rest() -> None:
    sdpa = estimate(ModelSpec(preset="qwen2.5-7b", context=4096, gradient_checkpointing=False))
    eager = estimate(ModelSpec(preset="qwen2.5-7b", context=4096, gradient_checkpointing=False, attention="eager"))
    assert eager.terms["activations"] > 2.5 * sdpa.terms["activations"]
    assert any("eager attention" in n for n in eager.notes)
    assert any("SDPA or flash attention" in n and "no padding mask" in n for n in sdpa.notes)


def test_lora_keeps_what_the_gradient_path_and_the_adapters_need_and_nothing_for_frozen_weights() -> None:
    h, q, kv, inter, heads, r = 3584, 28 * 128, 4 * 128, 18944, 28, 16
    lora = LoraTraining(rank=r, targets=frozenset({"q_proj", "k_proj", "v_proj", "o_proj"}))
    norms = 2 * (4 * h + 4)  # fp32 input, 1/rms: nothing for a frozen weight, no output for a frozen matmul
    attention = 2 * (2 * q + 2 * kv) + 4 * heads  # on the gradient's path: as in full fine-tuning
    mlp = 2 * 3 * inter  # gate, up, SiLU(gate); not the product, which only frozen down_proj reads
    adapters = 3 * (4 * h + 4 * r) + (4 * q + 4 * r)  # PEFT's fp32 adapters: each its own fp32 copy of its input
    assert layer_activation_bytes_per_token(QWEN7B, 2.0, lora=lora) == norms + attention + mlp + adapters
    # What frozen weights do not keep, the adapters' fp32 copies of their inputs about make up for: 4 % less.
    assert layer_activation_bytes_per_token(QWEN7B, 2.0, lora=lora) / layer_activation_bytes_per_token(
        QWEN7B, 2.0) == pytest.approx(0.96, abs=0.005)
    # In fp32 the adapters read the tensors themselves: q, k and v's input is kept once, o's is the attention output.
    fp32 = 2 * (4 * h + 4) + 4 * (2 * q + 2 * kv) + 4 * heads + 4 * 3 * inter + 4 * h + 4 * 4 * r
    assert layer_activation_bytes_per_token(QWEN7B, 4.0, lora=lora) == fp32
    # The head: the final norm keeps its fp32 input and 1/rms (frozen weight, frozen lm_head), then the loss's peak.
    assert head_bytes_per_token(QWEN7B, 2.0, lora) == 4 * h + 4 + 152064 * 14


def test_a_lora_estimate_sizes_its_activations_as_lora_keeps_them_and_says_so() -> None:
    full = estimate(ModelSpec(preset="qwen2.5-7b", context=1024, gradient_checkpointing=False))
    lora = estimate(ModelSpec(preset="qwen2.5-7b", context=1024, gradient_checkpointing=False, method="lora"))
    targets = LoraTraining(rank=16, targets=frozenset({"q_proj", "k_proj", "v_proj", "o_proj"}))
    expected = activation_bytes(QWEN7B, 1, 1024, 2.0, False, lora=targets) / 1e9
    assert lora.terms["activations"] == pytest.approx(expected) and expected < full.terms["activations"]
    assert any("each adapter its input and A's output in fp32" in n for n in lora.notes)


def test_the_loss_peaks_at_the_compute_dtype_logits_plus_three_fp32_buffers() -> None:
    # log-softmax's saved output, the gradient from nll_loss, the gradient log-softmax passes on: measured 14 B (bf16)
    # and 16 B (fp32) per logit entry with the model's outputs held through backward.
    assert logits_bytes_per_entry(2.0) == 14.0
    assert logits_bytes_per_entry(4.0) == 16.0
    assert head_bytes_per_token(QWEN7B, 2.0) == rmsnorm_bytes_per_token(3584, 2.0) + 152064 * 14


def test_without_checkpointing_every_layer_is_kept_and_the_head_peaks_on_top() -> None:
    spec = ModelSpec(preset="qwen2.5-7b", context=1024, micro_batch=2, gradient_checkpointing=False)
    tokens = 2 * 1024
    expected = tokens * (28 * layer_activation_bytes_per_token(QWEN7B, 2.0) + head_bytes_per_token(QWEN7B, 2.0))
    assert estimate(spec).terms["activations"] == pytest.approx(expected / 1e9)
    assert estimate(spec).terms["activations"] == pytest.approx(17.34, abs=0.01)


def test_with_checkpointing_layer_inputs_plus_the_larger_of_the_head_and_one_recomputed_layer() -> None:
    kept = estimate(ModelSpec(preset="qwen2.5-7b", gradient_checkpointing=False)).terms["activations"]
    ckpt = estimate(ModelSpec(preset="qwen2.5-7b", gradient_checkpointing=True)).terms["activations"]
    layer = layer_activation_bytes_per_token(QWEN7B, 2.0) + layer_backward_bytes_per_token(QWEN7B, 2.0)
    head = head_bytes_per_token(QWEN7B, 2.0)
    assert head > layer  # with a 152 k vocabulary the loss's peak is the larger, 7×
    assert ckpt == pytest.approx(2048 * (28 * 3584 * 2 + head) / 1e9)
    assert ckpt < kept / 3
    # Without a vocabulary the recomputed layer and its backward working set (2·I) are the larger.
    no_vocab = replace(QWEN7B, vocab_size=None)
    assert activation_bytes(no_vocab, 1, 2048, 2.0, True) == 2048 * (28 * 3584 * 2 + layer)


def test_activations_scale_with_micro_batch_and_context() -> None:
    one = estimate(ModelSpec(preset="llama-3.1-8b", micro_batch=1, context=1024)).terms["activations"]
    assert estimate(ModelSpec(preset="llama-3.1-8b", micro_batch=4, context=1024)).terms["activations"] \
        == pytest.approx(4 * one)
    assert estimate(ModelSpec(preset="llama-3.1-8b", micro_batch=1, context=4096)).terms["activations"] \
        == pytest.approx(4 * one)


def test_unknown_vocab_leaves_the_logits_out_and_says_so() -> None:
    spec = ModelSpec(params=7.61e9, layers=28, hidden_size=3584, attention_heads=28, kv_heads=4,
                     intermediate_size=18944, gradient_checkpointing=False)
    est = estimate(spec)
    with_vocab = estimate(spec.model_copy(update={"vocab_size": 152064}))
    # Without logits the last layer's backward working set (2·I) is the peak's top instead of the head.
    head_minus_working_set = head_bytes_per_token(QWEN7B, 2.0) - layer_backward_bytes_per_token(QWEN7B, 2.0)
    assert with_vocab.terms["activations"] - est.terms["activations"] == pytest.approx(
        2048 * head_minus_working_set / 1e9)
    assert any("vocab" in n for n in est.notes)


def test_rollout_kv_cache_uses_kv_heads_and_reports_the_naive_figure() -> None:
    est = estimate(ModelSpec(preset="qwen2.5-7b", method="qlora", group_size=8, prompts_per_step=2, context=4096))
    sequences = 8 * 2
    assert est.terms["kv_cache"] == pytest.approx(28 * 2 * 4 * 128 * 4096 * 2 * sequences / 1e9)
    assert est.kv_cache_naive_gb == pytest.approx(28 * 2 * 3584 * 4096 * 2 * sequences / 1e9)
    assert est.kv_cache_naive_gb / est.terms["kv_cache"] == pytest.approx(3584 / 512)  # 7× overstated
    assert "kv_heads" in est.kv_cache_formula
    assert any("hidden-size formula" in n for n in est.notes)


def test_rollout_kv_cache_and_training_activations_take_turns() -> None:
    # A plain generate frees its KV cache before the training forward (measured), so the larger of the two counts.
    est = estimate(ModelSpec(preset="qwen2.5-7b", method="qlora", group_size=8, prompts_per_step=1, context=4096))
    t = est.terms
    state = t["weights"] + t["gradients"] + t["optimizer"] + t["adapters"]
    assert t["activations"] > t["kv_cache"] > 0
    assert est.total_gb == pytest.approx(state + t["activations"])
    many = estimate(ModelSpec(preset="qwen2.5-7b", method="qlora", group_size=64, prompts_per_step=4, context=4096))
    assert many.terms["kv_cache"] > many.terms["activations"]
    m = many.terms
    assert many.total_gb == pytest.approx(m["weights"] + m["gradients"] + m["optimizer"] + m["adapters"]
                                          + m["kv_cache"])
    assert any("take turns" in n for n in many.notes)


def test_no_grpo_means_no_kv_cache_term() -> None:
    est = estimate(ModelSpec(preset="qwen2.5-7b"))
    assert est.terms["kv_cache"] == 0.0
    assert set(est.terms) == set(TERM_KEYS)


def test_grpo_without_prompts_per_step_assumes_one_prompt() -> None:
    est = estimate(ModelSpec(preset="llama-3.2-1b", group_size=8))
    assert est.terms["kv_cache"] == pytest.approx(16 * 2 * 8 * 64 * 2048 * 2 * 8 / 1e9)
    assert any("assuming 1" in n for n in est.notes)


# --- per GPU: DDP vs FSDP, and which cards fit --------------------------------------------------------------------


def test_ddp_replicates_everything_and_adds_its_gradient_buckets() -> None:
    one = estimate(ModelSpec(preset="llama-3.1-8b", parallelism="ddp"), gpus=1)
    four = estimate(ModelSpec(preset="llama-3.1-8b", parallelism="ddp"), gpus=4)
    assert four.total_gb == one.total_gb == one.per_gpu_gb
    # PyTorch DDP's all-reduce buckets hold a copy of the gradients (gradient_as_bucket_view=False, the default).
    assert four.per_gpu_gb == pytest.approx(four.total_gb + four.terms["gradients"])
    assert any("all-reduce buckets" in n for n in four.notes)


def test_fsdp_shards_model_state_but_not_activations_or_kv_cache() -> None:
    spec = ModelSpec(preset="llama-3.1-8b", parallelism="fsdp", group_size=4, prompts_per_step=2)
    est = estimate(spec, gpus=4)
    t = est.terms
    sharded = (t["weights"] + t["gradients"] + t["optimizer"] + t["adapters"]) / 4
    assert est.per_gpu_gb == pytest.approx(sharded + max(t["activations"], t["kv_cache"]))
    assert estimate(spec, gpus=1).per_gpu_gb == pytest.approx(est.total_gb)


def test_fits_keeps_gate_1s_margin_on_every_common_card() -> None:
    est = estimate(_seed_model(method="full"))
    assert set(est.fits) == set(COMMON_GPU_SIZES_GB)
    for size, ok in est.fits.items():  # each size by its card's memory as nvidia-smi reads it; 1 GiB kept free
        assert ok == (est.per_gpu_gb + 2**30 / 1e9 <= COMMON_GPUS[size][1] * 2**20 / 1e9)
    # A "24 GB" card is not 24 GiB: 7B LoRA at 3584 tokens (23.8 GB) fits 24 GiB less the margin (24.7 GB), not an
    # A10G's 23028 MiB less it (23.1 GB).
    lora = estimate(ModelSpec(preset="qwen2.5-7b", method="lora", context=3584))
    assert 23.1 < lora.per_gpu_gb < 24.7 and lora.fits[24] is False and lora.fits[40] is True
    assert estimate(_seed_model(method="full"), margin_gib=3.0).margin_gib == 3.0
    # The seed: a full 7.6 B fine-tune is past one 80 GB H100 on its own.
    assert est.fits[80] is False
    assert estimate(ModelSpec(preset="qwen2.5-1.5b", method="qlora")).fits[16] is True


def test_fits_in_compares_per_gpu_memory_plus_margin_with_vram() -> None:
    spec = ModelSpec(preset="qwen2.5-7b", method="qlora", group_size=8, prompts_per_step=1, context=4096)
    need = estimate(spec).per_gpu_gb
    assert fits_in(spec, vram_gb=need + 2.0, margin_gb=2.0)
    assert not fits_in(spec, vram_gb=need + 1.9, margin_gb=2.0)
    full = ModelSpec(preset="llama-3.1-8b", parallelism="fsdp")
    assert not fits_in(full, vram_gb=80, margin_gb=4)
    assert fits_in(full, vram_gb=80, margin_gb=4, gpus=4)


# --- bad input ----------------------------------------------------------------------------------------------------


def test_unknown_preset_names_the_field_and_the_known_presets() -> None:
    with pytest.raises(BadInput) as info:
        estimate(ModelSpec(preset="gpt-5"))
    assert info.value.field == "model.preset"
    for name in PRESETS:
        assert name in str(info.value)


def test_missing_architecture_fields_are_named() -> None:
    with pytest.raises(BadInput) as info:
        estimate(ModelSpec(params=7.6e9, layers=28))
    message = str(info.value)
    for missing in ("hidden_size", "attention_heads", "kv_heads", "intermediate_size"):
        assert missing in message
    assert "layers," not in message


def test_full_fine_tuning_of_quantized_weights_is_rejected() -> None:
    with pytest.raises(BadInput) as info:
        estimate(_seed_model(method="full", dtype="int4"))
    assert info.value.field == "model.dtype"


def test_unknown_lora_target_is_rejected() -> None:
    with pytest.raises(BadInput) as info:
        estimate(_seed_model(method="lora", lora_targets=["q_proj", "qkv"]))
    assert info.value.field == "model.lora_targets"
    assert "'qkv'" in str(info.value)


def test_bad_gpu_count_and_vram_are_rejected() -> None:
    with pytest.raises(BadInput):
        estimate(_seed_model(), gpus=0)
    with pytest.raises(BadInput):
        fits_in(_seed_model(), vram_gb=80, margin_gb=-1)


# --- `burstctl size` through the real entry point -----------------------------------------------------------------


def _burstctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from orchestrator.cli import entry; entry()", *args],
                          capture_output=True, text=True, timeout=60)


def test_size_json_reports_the_six_terms_fits_and_the_kv_formula() -> None:
    args = ["--model", "qwen2.5-7b", "--method", "qlora", "--group-size", "8", "--prompts", "2",
            "--context", "4096", "--gpus", "2", "--parallelism", "fsdp"]
    res = _burstctl("size", *args, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    expected = estimate(ModelSpec(preset="qwen2.5-7b", method="qlora", group_size=8, prompts_per_step=2,
                                  context=4096, parallelism="fsdp"), gpus=2)
    assert set(doc["terms"]) == set(TERM_KEYS)
    for key in TERM_KEYS:
        assert doc["terms"][key] == pytest.approx(expected.terms[key], abs=1e-4)
    assert doc["total_gb"] == pytest.approx(expected.total_gb, abs=1e-4)
    assert doc["per_gpu_gb"] == pytest.approx(expected.per_gpu_gb, abs=1e-4)
    assert doc["fits"] == {str(s): expected.fits[s] for s in COMMON_GPU_SIZES_GB}
    assert doc["fits_judged_on"]["80"] == {"card": "H100", "memory_mib": 81559}
    assert "kv_heads" in doc["kv_cache_formula"]
    assert doc["kv_cache_naive_gb"] > doc["terms"]["kv_cache"]
    assert doc["notes"]


def test_size_from_explicit_params_and_shapes_prints_a_table() -> None:
    res = _burstctl("size", "--params", "7.6e9", "--layers", "28", "--hidden", "3584", "--heads", "28",
                    "--kv-heads", "4", "--intermediate", "18944", "--vocab", "152064")
    assert res.returncode == 0, res.stderr
    for line_start in ("weights", "gradients", "optimizer", "total", "per GPU"):
        assert any(line.strip("│ ").startswith(line_start) for line in res.stdout.splitlines()), line_start
    assert "15.20" in res.stdout and "91.20" in res.stdout
    assert "80 GB no" in res.stdout and "141 GB yes" in res.stdout


def test_size_reads_the_model_table_of_a_job_file(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('name = "grpo"\ncommand = "python train.py"\n\n'
                   '[model]\npreset = "llama-3.2-1b"\nmethod = "lora"\ngroup_size = 4\n')
    res = _burstctl("size", "--job", str(job), "--context", "1024", "--json")
    assert res.returncode == 0, res.stderr
    expected = estimate(ModelSpec(preset="llama-3.2-1b", method="lora", group_size=4, context=1024))
    assert json.loads(res.stdout)["total_gb"] == pytest.approx(expected.total_gb, abs=1e-4)


@pytest.mark.parametrize(
    ("args", "mentions"),
    [
        (["--model", "gpt-5"], "--model"),
        (["--model", "qwen2.5-7b", "--context", "-5"], "--context"),
        (["--params", "-7e9"], "--params"),
        (["--layers", "28", "--hidden", "3584"], "--kv-heads"),
        (["--model", "qwen2.5-7b", "--method", "lora", "--lora-targets", "q_proj,nope"], "nope"),
        (["--model", "qwen2.5-7b", "--attention", "flash"], "--attention"),
    ],
)
def test_size_bad_input_exits_2_with_one_line(args: list[str], mentions: str) -> None:
    res = _burstctl("size", *args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert mentions in lines[0]
    assert "Traceback" not in res.stderr


def test_the_table_says_which_row_the_total_leaves_out_when_it_is_a_peak_not_a_sum() -> None:
    # A GRPO QLoRA: rollout and training take turns, so the KV cache's 1.88 GB is beside the total, not in it.
    res = _burstctl("size", "--model", "qwen2.5-7b", "--method", "qlora", "--group-size", "8", "--prompts", "4",
                    "--context", "1024")
    assert res.returncode == 0, res.stderr
    rows = {line.split("│")[1].strip(): line for line in res.stdout.splitlines() if line.count("│") == 4}
    assert "not in the total: it takes turns with the activations" in rows["kv_cache"]
    assert "not in the total" not in rows["activations"]
    assert "the peak, not the sum" in rows["total"]
    plain = _burstctl("size", "--model", "qwen2.5-7b", "--method", "lora")  # no rollouts: the rows add up
    assert "not in the total" not in plain.stdout and "the peak, not the sum" not in plain.stdout


def test_what_the_estimate_leaves_out_is_said_with_its_size_where_it_applies() -> None:
    def left_out(est: object) -> list[str]:
        return [n for n in est.notes if n.startswith("not counted")]  # type: ignore[attr-defined]

    # QLoRA: PEFT's kbit preparation casts the base's 16-bit parameters (1.09 B for Qwen2.5-7B) to fp32.
    qlora = estimate(ModelSpec(preset="qwen2.5-7b", method="qlora"))
    kept = 1.09e9
    assert any("prepare_model_for_kbit_training" in n and f"{kept * 2 / 1e9:.2f} GB more" in n
               for n in left_out(qlora))
    # Full fine-tuning: AdamW's foreach step holds sqrt(v) for every parameter in fp32 once activations are freed,
    # 30.4 GB for 7.6 B parameters against 4.8 GB of activations; sharded by FSDP like the state it works on.
    full = estimate(ModelSpec(preset="qwen2.5-7b"))
    workspace = full.trained_params * 4 / 1e9
    more = workspace - full.terms["activations"]
    assert any(f"{workspace:.2f} GB" in n and f"{more:.2f} GB more at the step" in n for n in left_out(full))
    fsdp = estimate(ModelSpec(preset="qwen2.5-7b", parallelism="fsdp"), gpus=4)
    assert any(f"{workspace / 4:.2f} GB" in n for n in left_out(fsdp))
    # FSDP: the root unit's embeddings and lm_head (2 × 545 M, untied) stay gathered, with their gradients under
    # full fine-tuning, and two layers are gathered at a time.
    assert any("FSDP's gathered parameters" in n and "about 5.29 GB more per GPU" in n for n in left_out(fsdp))
    # LoRA in bf16 has no quantized base to prepare and a step workspace of its adapters only: nothing to say.
    assert left_out(estimate(ModelSpec(preset="qwen2.5-7b", method="lora"))) == []


def test_a_full_fine_tune_trained_in_bf16_itself_keeps_adam_in_bf16_and_no_master_copy() -> None:
    # AMP (the default): bf16 weights and gradients, an fp32 master copy and two fp32 moments, 16 B/param. A model
    # loaded in bf16 and trained as is: 2 + 2 + 2×2 = 8 B/param, which puts a 1.2 B full fine-tune on a 16 GB card.
    amp = estimate(ModelSpec(preset="llama-3.2-1b"))
    pure = estimate(ModelSpec(preset="llama-3.2-1b", mixed_precision=False))
    params = amp.trained_params
    assert amp.terms["optimizer"] == pytest.approx(params * 12 / 1e9)
    assert pure.terms["optimizer"] == pytest.approx(params * 4 / 1e9)
    assert pure.terms["weights"] == amp.terms["weights"] and pure.terms["gradients"] == amp.terms["gradients"]
    assert (amp.fits[16], pure.fits[16]) == (False, True)
    assert any("mixed_precision = false" in n for n in pure.notes)
    # It is a full fine-tune's choice: LoRA's adapters (PEFT keeps them in fp32) and fp32 models are unchanged.
    for spec in ({"method": "lora"}, {"dtype": "fp32"}):
        assert estimate(ModelSpec(preset="llama-3.2-1b", mixed_precision=False, **spec)).terms == \
            estimate(ModelSpec(preset="llama-3.2-1b", **spec)).terms


def test_a_grpo_estimate_at_micro_batch_1_says_trl_trains_8_sequences_at_once_by_default() -> None:
    grpo = estimate(ModelSpec(preset="qwen2.5-7b", method="qlora", group_size=8))
    assert any("per_device_train_batch_size" in n for n in grpo.notes)
    assert not any("per_device_train_batch_size" in n
                   for n in estimate(ModelSpec(preset="qwen2.5-7b", method="qlora", group_size=8, micro_batch=8)).notes)
