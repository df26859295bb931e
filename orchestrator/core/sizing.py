"""Training-memory sizing: gate 1's input. Pure: a ModelSpec in, a per-term budget in GB (10^9 bytes) out.

The terms, all per model replica:

- weights: base parameters × bytes per parameter of the weights dtype (qlora and int4: bitsandbytes' 4-bit, 0.5625
  B/param with its per-block constants, 0.516 with `double_quant`). A quantized base (qlora, or lora on int8/int4)
  quantizes the blocks' linear layers only: bitsandbytes leaves the input embedding, the lm_head and the norms in
  16-bit (transformers' `get_keys_to_not_convert`), 1.09 B of Qwen2.5-7B's 7.62 B parameters;
- gradients: trained parameters only (all for full, adapters for lora/qlora) × compute-dtype bytes;
- optimizer: Adam, 12 B per trained parameter (fp32 master copy + two fp32 moments); 8 B when the weights are already
  fp32, because then there is no separate master copy;
- adapters: the LoRA adapter weights themselves, r × (d_in + d_out) per targeted matrix per layer, with the
  architecture's real matrix shapes (grouped-query k/v are narrower than q/o);
- activations: the peak of what the backward pass keeps, see `activation_bytes` (measured against transformers'
  Llama and Qwen2 by benchmarks/sizing_measured.py);
- kv_cache: GRPO rollouts, layers × 2 × kv_heads × head_dim × context × bytes × (G × prompts per step).

The total for one replica is the model state (weights, gradients, optimizer, adapters) plus the larger of the
activations and the KV cache: rollouts and training take turns.

Per GPU on g GPUs: DDP replicates everything and keeps a second copy of the gradients in its all-reduce buckets
(PyTorch's default, `gradient_as_bucket_view=False`); FSDP shards weights, gradients, optimizer state and adapters
over g while activations and the rollout KV cache stay whole on every GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from orchestrator.errors import BadInput
from orchestrator.jobspec import ModelSpec

GB = 1e9
GIB = 2**30
# Cards by their marketed size, each judged by a common card of that size as nvidia-smi reads it (memory.total, MiB):
# less than the label, and less than its GiB (a "24 GB" A10G has 23028 MiB = 24.15 GB, not 24 GiB = 25.77 GB).
COMMON_GPUS: dict[int, tuple[str, int]] = {16: ("RTX 5080", 16303), 24: ("A10G", 23028), 40: ("A100 40GB", 40960),
                                           48: ("L40S", 46068), 80: ("H100", 81559), 141: ("H200", 143771)}
COMMON_GPU_SIZES_GB: tuple[int, ...] = tuple(COMMON_GPUS)
MIB = 2**20
# Headroom kept free on every card for the CUDA context, allocator fragmentation and the terms this model leaves out:
# the same rule as gate 1 (`local.safety_margin_gib`, 1 GiB by default), so `size` and the daemon agree on a card.
# A policy, not a measurement.
DEFAULT_MARGIN_GIB = 1.0

WEIGHT_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0}
# bitsandbytes' 4-bit weights (NF4 or FP4, blocks of 64): half a byte each, plus each block's absmax in fp32 (4/64 B);
# double quantization stores the absmax in 8 bits (1/64 B) with an fp32 constant per 256 blocks: the QLoRA paper's
# 4.127 bits per parameter against 4.5.
FOUR_BIT_BYTES = 0.5 + 4 / 64
FOUR_BIT_DOUBLE_QUANT_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
ADAM_BYTES_MIXED = 12.0  # fp32 master copy 4 + first moment 4 + second moment 4
ADAM_BYTES_FP32 = 8.0  # the weights are the fp32 master copy already
FP32_BYTES = 4.0
# The loss's peak per logit entry above the compute-dtype logits: three fp32 buffers (log-softmax's output, the
# gradients in and out of it); measured, see `logits_bytes_per_entry`.
LOSS_LOGIT_BYTES = 3 * FP32_BYTES

LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_ALL_LINEAR = "all-linear"

TERM_KEYS: tuple[str, ...] = ("weights", "gradients", "optimizer", "adapters", "activations", "kv_cache")
SHARDED_BY_FSDP: frozenset[str] = frozenset({"weights", "gradients", "optimizer", "adapters"})

KV_CACHE_FORMULA = "layers × 2 × kv_heads × head_dim × context × bytes × (G × prompts per step)"
KV_CACHE_NAIVE_FORMULA = "layers × 2 × hidden_size × context × bytes × (G × prompts per step)"


@dataclass(frozen=True)
class Architecture:
    """The shapes sizing needs. vocab_size may be unknown for a hand-described model (then logits are not counted)."""

    params: float
    layers: int
    hidden_size: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int | None

    @property
    def q_dim(self) -> int:
        return self.attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class Preset:
    arch: Architecture
    tied_embeddings: bool  # lm_head shares the input embedding matrix
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2) or not (Llama)


# Numbers from each model's published config.json on the Hugging Face Hub; params are the published counts, which
# `count_params` reproduces from the shapes (tests check the two agree).
PRESETS: dict[str, Preset] = {
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json (same shapes as Qwen2.5-7B-Instruct); 7.61 B.
    "qwen2.5-7b": Preset(
        Architecture(params=7.61e9, layers=28, hidden_size=3584, attention_heads=28, kv_heads=4, head_dim=128,
                     intermediate_size=18944, vocab_size=152064),
        tied_embeddings=False, qkv_bias=True,
    ),
    # https://huggingface.co/Qwen/Qwen2.5-1.5B/blob/main/config.json; 1.54 B, tied embeddings.
    "qwen2.5-1.5b": Preset(
        Architecture(params=1.54e9, layers=28, hidden_size=1536, attention_heads=12, kv_heads=2, head_dim=128,
                     intermediate_size=8960, vocab_size=151936),
        tied_embeddings=True, qkv_bias=True,
    ),
    # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json; 8.03 B.
    "llama-3.1-8b": Preset(
        Architecture(params=8.03e9, layers=32, hidden_size=4096, attention_heads=32, kv_heads=8, head_dim=128,
                     intermediate_size=14336, vocab_size=128256),
        tied_embeddings=False, qkv_bias=False,
    ),
    # https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json; 1.24 B, tied embeddings, head_dim 64.
    "llama-3.2-1b": Preset(
        Architecture(params=1.24e9, layers=16, hidden_size=2048, attention_heads=32, kv_heads=8, head_dim=64,
                     intermediate_size=8192, vocab_size=128256),
        tied_embeddings=True, qkv_bias=False,
    ),
}

# Fields shared by ModelSpec and Architecture. Without a preset the first six are required; head_dim defaults to
# hidden_size / attention_heads and vocab_size may stay unknown.
_REQUIRED_WITHOUT_PRESET: tuple[str, ...] = (
    "params", "layers", "hidden_size", "attention_heads", "kv_heads", "intermediate_size",
)
_ARCH_FIELDS: tuple[str, ...] = (*_REQUIRED_WITHOUT_PRESET, "head_dim", "vocab_size")


@dataclass(frozen=True)
class SizingEstimate:
    terms: dict[str, float]  # the six TERM_KEYS, GB for one unsharded replica
    total_gb: float  # model state + the larger of activations and KV cache: what a single GPU needs
    per_gpu_gb: float  # on `gpus` GPUs with `parallelism`
    fits: dict[int, bool]  # common GPU size (marketed GB) -> per_gpu_gb fits its COMMON_GPUS card, margin_gib kept free
    notes: list[str] = field(default_factory=list)
    gpus: int = 1
    parallelism: str = "ddp"
    params: float = 0.0
    trained_params: float = 0.0
    kv_cache_formula: str = KV_CACHE_FORMULA
    kv_cache_naive_gb: float = 0.0  # the hidden-size formula, for comparison only
    margin_gib: float = DEFAULT_MARGIN_GIB

    def to_json(self) -> dict[str, Any]:
        """The `burstctl size --json` document."""
        return {
            "terms": {k: round(v, 4) for k, v in self.terms.items()},
            "total_gb": round(self.total_gb, 4),
            "per_gpu_gb": round(self.per_gpu_gb, 4),
            "gpus": self.gpus,
            "parallelism": self.parallelism,
            "fits": {str(size): ok for size, ok in self.fits.items()},
            "fits_judged_on": {str(size): {"card": card, "memory_mib": mib}
                               for size, (card, mib) in COMMON_GPUS.items()},
            "margin_gib": self.margin_gib,
            "params": self.params,
            "trained_params": self.trained_params,
            "kv_cache_formula": self.kv_cache_formula,
            "kv_cache_naive_formula": KV_CACHE_NAIVE_FORMULA,
            "kv_cache_naive_gb": round(self.kv_cache_naive_gb, 4),
            "notes": self.notes,
        }


def count_params(preset: Preset) -> int:
    """Parameters of a Llama/Qwen2-style decoder from its shapes: embeddings, per-layer attention + SwiGLU MLP + two
    RMSNorms, final norm, and an untied lm_head when not tied."""
    a = preset.arch
    attention = 2 * a.hidden_size * a.q_dim + 2 * a.hidden_size * a.kv_dim
    if preset.qkv_bias:
        attention += a.q_dim + 2 * a.kv_dim
    mlp = 3 * a.hidden_size * a.intermediate_size
    per_layer = attention + mlp + 2 * a.hidden_size
    vocab = a.vocab_size or 0
    embeddings = vocab * a.hidden_size * (1 if preset.tied_embeddings else 2)
    return a.layers * per_layer + embeddings + a.hidden_size


def missing_architecture_fields(model: ModelSpec) -> list[str]:
    """ModelSpec fields an estimate still needs: none with a preset, else the required architecture fields not given."""
    if model.preset is not None:
        return []
    return [name for name in _REQUIRED_WITHOUT_PRESET if getattr(model, name) is None]


def resolve_architecture(model: ModelSpec) -> tuple[Architecture, list[str]]:
    """The preset's architecture with any explicitly given field overriding it, or the explicit fields alone."""
    given = {name: getattr(model, name) for name in _ARCH_FIELDS if getattr(model, name) is not None}
    notes: list[str] = []
    if model.preset is not None:
        preset = PRESETS.get(model.preset.lower())
        if preset is None:
            raise BadInput(f"unknown preset '{model.preset}'; known presets: {', '.join(sorted(PRESETS))}",
                           field="model.preset")
        arch = replace(preset.arch, **given)
        if given:
            notes.append(f"{model.preset.lower()} with overrides: "
                         + ", ".join(f"{k}={_fmt_count(v)}" for k, v in given.items()))
        return arch, notes

    missing = missing_architecture_fields(model)
    if missing:
        raise BadInput(f"needs a preset ({', '.join(sorted(PRESETS))}) or the architecture fields "
                       f"{', '.join(missing)}", field="model")
    head_dim = given.get("head_dim")
    if head_dim is None:
        if given["hidden_size"] % given["attention_heads"]:
            raise BadInput(f"hidden_size {given['hidden_size']} is not a multiple of attention_heads "
                           f"{given['attention_heads']}; give head_dim", field="model.head_dim")
        head_dim = given["hidden_size"] // given["attention_heads"]
    if given["attention_heads"] % given["kv_heads"]:
        raise BadInput(f"attention_heads {given['attention_heads']} is not a multiple of kv_heads "
                       f"{given['kv_heads']}", field="model.kv_heads")
    arch = Architecture(params=float(given["params"]), layers=given["layers"], hidden_size=given["hidden_size"],
                        attention_heads=given["attention_heads"], kv_heads=given["kv_heads"], head_dim=head_dim,
                        intermediate_size=given["intermediate_size"], vocab_size=given.get("vocab_size"))
    return arch, notes


def lora_matrix_shapes(arch: Architecture) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each adaptable matrix in one layer."""
    h, inter = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (h, arch.q_dim),
        "k_proj": (h, arch.kv_dim),
        "v_proj": (h, arch.kv_dim),
        "o_proj": (arch.q_dim, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def normalize_lora_targets(targets: list[str]) -> list[str]:
    """Validated target names, de-duplicated in the order given; 'all-linear' means all seven matrices."""
    result: list[str] = []
    for raw in targets:
        name = raw.strip().lower()
        names = list(LORA_TARGETS) if name == LORA_ALL_LINEAR else [name]
        for n in names:
            if n not in LORA_TARGETS:
                raise BadInput(f"unknown LoRA target '{raw}'; expected some of {', '.join(LORA_TARGETS)} "
                               f"or {LORA_ALL_LINEAR}", field="model.lora_targets")
            if n not in result:
                result.append(n)
    if not result:
        raise BadInput(f"is empty; name at least one of {', '.join(LORA_TARGETS)}", field="model.lora_targets")
    return result


def lora_adapter_params(arch: Architecture, rank: int, targets: list[str]) -> int:
    """r × (d_in + d_out) per targeted matrix per layer."""
    shapes = lora_matrix_shapes(arch)
    per_layer = sum(rank * (shapes[t][0] + shapes[t][1]) for t in normalize_lora_targets(targets))
    return arch.layers * per_layer


@dataclass(frozen=True)
class LoraTraining:
    """What LoRA trains: adapters of `rank` on the `targets` matrices of every layer; every base weight, norm and the
    lm_head frozen. A frozen matmul keeps nothing of its input for backward (its input's gradient needs only the
    weight); only what trained weights or the gradient's path need is kept."""

    rank: int
    targets: frozenset[str]


def rmsnorm_bytes_per_token(hidden_size: int, compute_bytes: float, weight_trained: bool = True,
                            output_kept: bool = True) -> float:
    """What one Llama/Qwen2 RMSNorm keeps for backward, per token: its input upcast to fp32 (4 B; in an fp32 model the
    input itself), 1/rms in fp32 (4 B), and the normalized value before and after the weight in the compute dtype
    (the latter is the next matmul's input). Measured exactly (benchmarks/sizing_measured.py): bf16 8h + 4 bytes,
    fp32 12h + 4. A frozen weight (LoRA) needs no normalized value for its gradient, and an output that only frozen
    matmuls read is not kept."""
    kept = FP32_BYTES + compute_bytes * (int(weight_trained) + int(output_kept))
    return hidden_size * kept + FP32_BYTES


def layer_activation_bytes_per_token(arch: Architecture, compute_bytes: float, attention: str = "sdpa",
                                     context: int = 0, padding_mask: bool = False,
                                     lora: LoraTraining | None = None) -> float:
    """Bytes one decoder layer keeps for its backward pass, per token, as measured on transformers' Llama and Qwen2
    (benchmarks/sizing_measured.py: saved tensors, exact to the byte but for RoPE's cos/sin shared by all layers).

    Two RMSNorms (`rmsnorm_bytes_per_token`). Attention: q, k and v after RoPE (q_dim + 2·kv_dim; grouped-query k/v
    stay narrow, SDPA's enable_gqa, when there is no padding mask) and the attention output fed to o_proj (q_dim) in
    the compute dtype, plus the kernel's fp32 log-sum-exp per head; a fused (SDPA / flash) kernel keeps no
    context × context score matrix. SwiGLU MLP: the gate and up outputs (2·I), SiLU(gate) (I) and the product fed to
    down_proj (I). Korthikanti et al. 2022's accounting (34·s·b·h bytes per GPT layer), redone for these ops; their
    count of the norms' inputs at the compute dtype was 10-20 % low (measured 1.12 fp32, 1.24 bf16 on the small model).

    With SDPA and a padding mask, k and v are repeated to the query heads (2·(q_dim − kv_dim) more) and the layer
    keeps its own context × context copy of the mask in the compute dtype (`context` per token). Eager attention
    keeps no log-sum-exp but the repeated k/v and, per head and key, the fp32 softmax and its compute-dtype copy
    (none in fp32, where the copy is the softmax itself): `context` · heads · (4 + b) per token, 3.3× the layer at
    512 tokens; a padding mask adds nothing to it (added to the scores, not kept).

    With LoRA (`lora`) the norms keep no normalized value for their frozen weights, and a frozen matmul nothing of
    its input. The attention's q, k, v and output and the MLP's gate, up and SiLU(gate) are on the gradient's path
    and kept as in full fine-tuning. Each adapter keeps its input and its A's output (rank) in the adapters' dtype,
    fp32 (PEFT's default): in a 16-bit model every adapter keeps its own fp32 copy of its input (q, k and v three of
    the same one); in an fp32 model the input itself, kept once however many adapters read it. Measured on PEFT
    0.21 (benchmarks/sizing_measured.py): exact but for the first layer, whose input norm keeps nothing when the
    embedding is frozen.
    """
    qkv_out = compute_bytes * (2 * arch.q_dim + 2 * arch.kv_dim)
    repeated_kv = compute_bytes * 2 * (arch.q_dim - arch.kv_dim)
    if attention == "eager":
        copy = 0.0 if compute_bytes == FP32_BYTES else compute_bytes
        attention_bytes = qkv_out + repeated_kv + arch.attention_heads * context * (FP32_BYTES + copy)
    else:
        attention_bytes = qkv_out + FP32_BYTES * arch.attention_heads
        if padding_mask:
            attention_bytes += repeated_kv + compute_bytes * context
    if lora is None:
        mlp = compute_bytes * 4 * arch.intermediate_size
        return 2 * rmsnorm_bytes_per_token(arch.hidden_size, compute_bytes) + attention_bytes + mlp
    shapes = lora_matrix_shapes(arch)
    if compute_bytes < FP32_BYTES:  # each adapter's fp32 copy of its input
        inputs = sum(FP32_BYTES * shapes[t][0] for t in lora.targets)
    else:  # the inputs themselves, one per distinct input; o_proj's is the attention output, kept already
        read = {"norm1" if t in ("q_proj", "k_proj", "v_proj") else "norm2" if t in ("gate_proj", "up_proj")
                else t for t in lora.targets}
        inputs = FP32_BYTES * (arch.hidden_size * len(read & {"norm1", "norm2"})
                               + arch.intermediate_size * int("down_proj" in read))
    adapters = inputs + FP32_BYTES * lora.rank * len(lora.targets)
    norms = 2 * rmsnorm_bytes_per_token(arch.hidden_size, compute_bytes, weight_trained=False, output_kept=False)
    return norms + attention_bytes + compute_bytes * 3 * arch.intermediate_size + adapters


def logits_bytes_per_entry(compute_bytes: float) -> float:
    """Bytes per logit entry (token × vocab) at the peak of transformers' standard cross-entropy loss: the logits in the
    compute dtype, which the model returns, and three fp32 buffers during the loss's backward (log-softmax's saved
    output, the gradient nll_loss passes back, the gradient log-softmax passes on). Measured: 14 B in bf16, 16 B in
    fp32 with the outputs held through backward (`out = model(...); out.loss.backward()`); 12 B when only the loss is
    kept (transformers' Trainer drops the outputs). The estimate takes the held figure."""
    return compute_bytes + LOSS_LOGIT_BYTES


def head_bytes_per_token(arch: Architecture, compute_bytes: float, lora: LoraTraining | None = None) -> float:
    """The final RMSNorm (its output is the lm_head's input) and the logits' peak, per token; no logits when the vocab
    is unknown. With LoRA the norm's weight and the lm_head are frozen: the norm keeps its fp32 input and 1/rms."""
    logits = (arch.vocab_size or 0) * logits_bytes_per_entry(compute_bytes)
    trained = lora is None
    return rmsnorm_bytes_per_token(arch.hidden_size, compute_bytes, trained, trained) + logits


def layer_backward_bytes_per_token(arch: Architecture, compute_bytes: float, attention: str = "sdpa",
                                   context: int = 0) -> float:
    """The working set of one layer's backward above what it saved, per token: the MLP's backward holds the gradients
    of SiLU(gate) and of up (2·I) while the layer's saved tensors are still alive. Measured 2.07·I (fp32) and 2.44·I
    (bf16) in the compute dtype on the small model with a 16-entry vocab (benchmarks/sizing_measured.py).
    Eager attention's backward runs after the MLP's, once what the MLP saved (4·I) is freed, and holds per head and
    key the softmax's gradient in the compute dtype and the scores' in fp32 (heads · `context` · (b + 4)), plus the
    gradients of q and of the repeated k and v (3·q_dim): the larger of the two phases counts. Measured peaks on the
    small model, eager, 512 and 1024 tokens, with and without checkpointing: 0.93-0.99 of the estimate (1.10-1.38
    before this term, when the MLP's working set stood for every layer's)."""
    mlp = compute_bytes * 2 * arch.intermediate_size
    if attention != "eager":
        return mlp
    scores = arch.attention_heads * context * (compute_bytes + FP32_BYTES) + compute_bytes * 3 * arch.q_dim
    return max(mlp, scores - compute_bytes * 4 * arch.intermediate_size)


def activation_bytes(arch: Architecture, micro_batch: int, context: int, compute_bytes: float,
                     checkpointing: bool, attention: str = "sdpa", padding_mask: bool = False,
                     lora: LoraTraining | None = None) -> float:
    """Peak activation memory of one micro-batch of `micro_batch` sequences of `context` tokens.

    Everything the layers keep is alive when the backward pass starts; on top of it comes first the head's peak (the
    loss's fp32 buffers), then, once the head has released its buffers, one layer's backward working set. Without
    checkpointing every layer keeps its full set. With (per-layer) checkpointing each layer keeps only its input (h per
    token) and is recomputed after the head's backward, one layer at a time, so one full layer and its working set
    take the head's place (measured: the two phases do not overlap; adding them overstated the peak up to 1.6×).
    With a real vocabulary the head is the larger (Qwen2.5-7B in bf16: 2.16 MB per token against 0.30 MB).
    """
    tokens = micro_batch * context
    layer = layer_activation_bytes_per_token(arch, compute_bytes, attention, context, padding_mask, lora)
    backward = layer_backward_bytes_per_token(arch, compute_bytes, attention, context)
    head = head_bytes_per_token(arch, compute_bytes, lora)
    if checkpointing:
        per_token = arch.layers * arch.hidden_size * compute_bytes + max(head, layer + backward)
    else:
        per_token = arch.layers * layer + max(head, backward)
    return tokens * per_token


def kv_cache_bytes(arch: Architecture, context: int, sequences: int, compute_bytes: float) -> float:
    """Grouped-query attention KV cache: only kv_heads × head_dim per token per layer for each of K and V."""
    return arch.layers * 2 * arch.kv_heads * arch.head_dim * context * compute_bytes * sequences


def kv_cache_bytes_naive(arch: Architecture, context: int, sequences: int, compute_bytes: float) -> float:
    """The textbook hidden-size formula; right only for plain multi-head attention."""
    return arch.layers * 2 * arch.hidden_size * context * compute_bytes * sequences


def _embedding_params(model: ModelSpec, arch: Architecture) -> float:
    """The input embedding and the lm_head: one matrix if tied, as a preset says; a hand-described model is taken as
    untied (the larger figure). 0 without a known vocab."""
    preset = PRESETS.get(model.preset.lower()) if model.preset else None
    tied = preset.tied_embeddings if preset is not None else False
    return float((arch.vocab_size or 0) * arch.hidden_size * (1 if tied else 2))


def unquantized_params(model: ModelSpec, arch: Architecture) -> float:
    """Parameters a quantized base keeps in 16-bit: the input embedding, an untied lm_head and the norms. A
    hand-described model is taken as untied (the larger figure) when its vocab is known."""
    return _embedding_params(model, arch) + arch.hidden_size * (2 * arch.layers + 1)


def gb_and_gib(gb: float) -> str:
    """A memory size as estimates give it (GB) and as configs set it (GiB): `17.1 GB = 15.92 GiB`."""
    return f"{gb:.1f} GB = {gb * GB / GIB:.2f} GiB"


def estimate(model: ModelSpec, gpus: int = 1, margin_gib: float = DEFAULT_MARGIN_GIB) -> SizingEstimate:
    """The per-term memory budget of training `model`, what it needs per GPU on `gpus` GPUs, and which common cards
    it fits with `margin_gib` kept free on each."""
    if gpus < 1:
        raise BadInput(f"must be at least 1, got {gpus}", field="gpus")
    arch, notes = resolve_architecture(model)
    if model.method == "full" and model.dtype in ("int8", "int4"):
        raise BadInput(f"full fine-tuning trains the weights themselves and needs fp32, bf16 or fp16, not "
                       f"{model.dtype}; quantized base weights go with method lora or qlora", field="model.dtype")

    # Activations, KV cache, adapters and their gradients live in the compute dtype: fp32 only for fp32 models,
    # else 16-bit (a quantized base is dequantized to bf16 for the matmuls).
    compute_bytes = 4.0 if model.dtype == "fp32" else 2.0
    four_bit = model.method == "qlora" or model.dtype == "int4"
    base_bytes = (FOUR_BIT_DOUBLE_QUANT_BYTES if model.double_quant else FOUR_BIT_BYTES) if four_bit \
        else WEIGHT_BYTES[model.dtype]
    quantized = four_bit or model.dtype == "int8"
    kept_16bit = min(unquantized_params(model, arch), arch.params) if quantized else 0.0
    pure = model.method == "full" and compute_bytes == 2.0 and not model.mixed_precision
    # Pure 16-bit: two Adam moments in the dtype, no master copy; else fp32 moments (and a master copy if 16-bit).
    adam_bytes = 2 * compute_bytes if pure else ADAM_BYTES_FP32 if compute_bytes == 4.0 else ADAM_BYTES_MIXED

    lora = None
    if model.method == "full":
        adapter_params = 0
        trained = arch.params
        notes.append(f"full fine-tuning: gradients and Adam ({adam_bytes:g} B/param) on all "
                     f"{_fmt_count(arch.params)} parameters"
                     + (f", trained in {model.dtype} itself (mixed_precision = false: no fp32 master copy; Adam's "
                        f"moments in {model.dtype})" if pure else ""))
    else:
        targets = normalize_lora_targets(model.lora_targets)
        lora = LoraTraining(rank=model.lora_rank, targets=frozenset(targets))
        adapter_params = lora_adapter_params(arch, model.lora_rank, targets)
        trained = float(adapter_params)
        base = (f"4-bit base weights ({base_bytes:.4g} B/param, "
                f"{'with' if model.double_quant else 'no'} double quantization)" if four_bit
                else f"{model.dtype} base weights")
        if quantized:
            base += (f", but {_fmt_count(kept_16bit)} of them (embeddings, lm_head, norms) stay 16-bit, as "
                     "bitsandbytes leaves them")
        notes.append(f"{model.method}: frozen {base}; {_fmt_count(adapter_params)} adapter parameters "
                     f"(r={model.lora_rank} on {', '.join(targets)}) carry the gradients and Adam state")
        if kept_16bit * 2.0 / GB >= 0.01:
            notes.append(f"not counted: PEFT's prepare_model_for_kbit_training (TRL's SFTTrainer calls it for a "
                         f"quantized base) casts those 16-bit parameters to fp32: {kept_16bit * 2.0 / GB:.2f} GB more")

    sequences = 0
    if model.group_size > 0:
        prompts = model.prompts_per_step
        if prompts == 0:
            prompts = 1
            notes.append("GRPO prompts per step not given: assuming 1")
        sequences = model.group_size * prompts
        if model.micro_batch == 1:
            notes.append("training micro-batch 1 per GPU: TRL's GRPOConfig defaults per_device_train_batch_size to "
                         "8 (and releases before steps_per_generation want a multiple of G); give micro_batch if "
                         "yours trains more sequences at once")

    # PEFT keeps adapters in fp32 (autocast_adapter_dtype): their gradients are fp32, and Adam needs no master copy.
    trained_bytes, trained_adam = (compute_bytes, adam_bytes) if lora is None else (FP32_BYTES, ADAM_BYTES_FP32)
    terms = {
        "weights": ((arch.params - kept_16bit) * base_bytes + kept_16bit * 2.0) / GB,
        "gradients": trained * trained_bytes / GB,
        "optimizer": trained * trained_adam / GB,
        "adapters": adapter_params * trained_bytes / GB,
        "activations": activation_bytes(arch, model.micro_batch, model.context, compute_bytes,
                                         model.gradient_checkpointing, model.attention, model.padding_mask,
                                         lora) / GB,
        "kv_cache": kv_cache_bytes(arch, model.context, sequences, compute_bytes) / GB,
    }
    naive_kv = kv_cache_bytes_naive(arch, model.context, sequences, compute_bytes) / GB

    recompute = "gradient checkpointing: layer inputs + the larger of one recomputed layer and the logits" \
        if model.gradient_checkpointing else "no checkpointing: every layer's activations + the logits"
    layer = layer_activation_bytes_per_token(arch, compute_bytes, model.attention, model.context, model.padding_mask,
                                             lora)
    kept = ("eager attention: each layer keeps its softmax, heads × context per token" if model.attention == "eager"
            else "SDPA or flash attention: no context × context scores kept")
    notes.append(f"activations: micro-batch {model.micro_batch} × {model.context} tokens, {recompute} "
                 f"({layer / 1e3:.0f} kB per token per full layer, {logits_bytes_per_entry(compute_bytes):g} B per "
                 f"logit entry at the loss's peak); {kept}"
                 + ("; padded under a mask: k/v repeated per query head, a context² mask per layer"
                    if model.padding_mask else "; no padding mask")
                 + ("; frozen matmuls keep nothing of their inputs, each adapter its input and A's output in fp32 "
                    "(PEFT's adapter dtype)" if lora is not None else ""))
    if arch.vocab_size is None:
        notes.append("vocab size unknown: the output logits (often GBs at long context) are not counted"
                     + ("; nor the 16-bit embeddings and lm_head of the quantized base, counted as quantized"
                        if quantized else ""))
    if sequences:
        ratio = naive_kv / terms["kv_cache"]
        notes.append(f"rollout KV cache for {sequences} concurrent sequences (G={model.group_size} × "
                     f"{sequences // model.group_size} prompts) at "
                     f"{model.context} tokens: {terms['kv_cache']:.2f} GB with {arch.kv_heads} KV heads × "
                     f"{arch.head_dim}; the hidden-size formula would say {naive_kv:.2f} GB ({ratio:.1f}× more)")
        larger = "KV cache" if terms["kv_cache"] > terms["activations"] else "activations"
        notes.append(f"rollout and training take turns (a plain generate frees its KV cache before the training "
                     f"forward): the larger of the KV cache and the activations ({larger}) counts, not both")
        if model.method == "full":
            notes.append("not counted: a frozen reference model for the GRPO KL term (another copy of the weights "
                         "when beta > 0) and the rollout engine's own overhead")
        else:  # TRL gets the reference from a PEFT model by turning its adapters off: no second copy
            notes.append("not counted: the rollout engine's own overhead (the GRPO reference model is the base "
                         "with its adapters off, no second copy)")

    # Generation and training take turns: transformers' generate releases its KV cache when it returns, before the
    # training forward (measured: 0.01 MB left of a 1 MB cache, benchmarks/sizing_measured.py), so the peak holds the
    # larger of the two, not their sum.
    turns = max(terms["activations"], terms["kv_cache"])
    if model.method == "full":
        # torch.optim.AdamW's default (foreach) step allocates sqrt(v) for every trained tensor, once the backward's
        # activations are freed: the peak is the larger of the two.
        workspace = trained * (compute_bytes if pure else FP32_BYTES) / GB / (gpus if model.parallelism == "fsdp"
                                                                                else 1)
        if workspace > turns:
            state_dtype = model.dtype if pure else "fp32"
            notes.append(f"not counted: AdamW's step workspace (torch's default foreach implementation: a temporary "
                         f"of the trained parameters in {state_dtype}, {workspace:.2f} GB, when the activations are "
                         f"freed): {workspace - turns:.2f} GB more at the step; fused=True needs none")
    state = sum(terms[k] for k in SHARDED_BY_FSDP)
    total = state + turns
    if model.parallelism == "fsdp":
        per_gpu = state / gpus + turns
        if gpus == 1:
            notes.append("fsdp on 1 GPU shards nothing")
        else:
            notes.append(f"fsdp over {gpus} GPUs: weights, gradients, optimizer and adapters sharded; "
                         "activations and KV cache stay per GPU")
            # The root unit (embeddings, lm_head) is not resharded after the forward, and each layer is gathered
            # whole while it runs, with the next one prefetched.
            embeddings = _embedding_params(model, arch)
            layer_params = max(arch.params - embeddings, 0.0) / arch.layers
            gathered = (embeddings * (base_bytes + compute_bytes * (model.method == "full"))
                        + 2 * layer_params * base_bytes) / GB
            notes.append(f"not counted: FSDP's gathered parameters, the root unit's embeddings and lm_head kept whole"
                         f"{' with their gradients' if model.method == 'full' else ''} and the layer running and "
                         f"the one prefetched: about {gathered:.2f} GB more per GPU")
    else:
        per_gpu = total
        if gpus > 1:
            # DDP all-reduces gradients through buckets that hold a copy of them (gradient_as_bucket_view=False).
            per_gpu += terms["gradients"]
            notes.append(f"ddp over {gpus} GPUs: every GPU holds everything, plus a copy of the gradients in "
                         f"DDP's all-reduce buckets ({terms['gradients']:.2f} GB); fsdp shards it")

    fits = {size: per_gpu + margin_gib * GIB / GB <= mib * MIB / GB for size, (_, mib) in COMMON_GPUS.items()}
    return SizingEstimate(terms=terms, total_gb=total, per_gpu_gb=per_gpu, fits=fits, notes=notes, gpus=gpus,
                          parallelism=model.parallelism, params=arch.params, trained_params=trained,
                          kv_cache_naive_gb=naive_kv, margin_gib=margin_gib)


def fits_in(model: ModelSpec, vram_gb: float, margin_gb: float, gpus: int = 1) -> bool:
    """Gate 1: does training `model` on `gpus` GPUs of `vram_gb` each leave at least `margin_gb` free per GPU?"""
    if vram_gb <= 0:
        raise BadInput(f"must be positive, got {vram_gb}", field="vram_gb")
    if margin_gb < 0:
        raise BadInput(f"must not be negative, got {margin_gb}", field="margin_gb")
    return estimate(model, gpus).per_gpu_gb + margin_gb <= vram_gb


def _fmt_count(v: float) -> str:
    """7.6e9 -> '7.60 B', 2.5e7 -> '25.0 M', 28 -> '28'."""
    if v >= 1e9:
        return f"{v / 1e9:.2f} B"
    if v >= 1e6:
        return f"{v / 1e6:.1f} M"
    return f"{v:g}"
