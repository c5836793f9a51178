"""Structured config schemas (registered in Hydra's ConfigStore by ``msar_train.config.store``).

Config is data: these dataclasses hold fields and defaults only. Cross-field checks live in
``msar_train.config.validate``; building models/optimizers lives in the packages that own them.
No torch import here (composition must stay cheap and importable anywhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class MoEConfig:
    n_routed: int = 8  # fine-grained routed experts
    n_shared: int = 1  # always-on shared experts
    top_k: int = 2
    expert_hidden: int = 128  # hidden width of one routed (and one shared) expert
    score_func: str = "softmax"  # softmax (DeepSeekMoE) | sigmoid (DeepSeek-V3)
    norm_topk_prob: bool = False  # renormalise the selected top-k weights to sum to 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1  # group-limited routing: experts split into n_group groups ...
    topk_group: int = 1  # ... and only the best topk_group groups may be chosen
    aux_loss_coef: float = 0.0  # expert-level balance loss (DeepSeekMoE alpha_1); 0 = off
    seq_aux_loss_coef: float = 0.0  # sequence-wise balance loss (DeepSeek-V3 alpha); 0 = off
    bias_update: bool = True  # auxiliary-loss-free balancing (bias on selection scores)
    bias_update_rate: float = 1e-3  # gamma: bias += rate * sign(mean_load - load)


@dataclass
class ModelConfig:
    name: str = "tiny"
    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4  # < n_heads: grouped-query attention
    head_dim: int | None = None  # default d_model // n_heads
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    first_k_dense: int = 1  # the first k blocks use a dense SwiGLU FFN instead of MoE
    dense_hidden: int = 384  # hidden width of the dense SwiGLU FFN
    moe: MoEConfig = field(default_factory=MoEConfig)
    tie_embeddings: bool = False
    init_std: float = 0.02


@dataclass
class ResidualConfig:
    name: str = "msar"  # vanilla | mhc | attnres | msar
    # attnres / msar: number of summary blocks; null = one block per branch (Full variant)
    n_blocks: int | None = 8
    # msar
    num_streams: int = 4
    kernel_sizes: list[int] = field(default_factory=lambda: [4, 8, 12])  # one per stream r >= 1
    fusion: str = "adaptive"  # adaptive | mean
    expansion: str = "conv"  # conv | none
    fusion_scale_init: float = 0.01  # a_l
    conv_init_smoothing: float = 0.1  # conv taps at init: (1 - s) * identity + s * moving average (docs/decisions.md)
    kernel: str = "torch"  # attnres/msar depth attention: torch (memory-lean) | triton (fused) | compile (torch.compile'd torch path)
    # mhc
    mhc_streams: int = 4
    sinkhorn_iters: int = 20
    mhc_scale_init: float = 0.01  # a_pre, a_post, a_res
    mhc_res_diag_init: float = 2.0  # b_res diagonal: Hres starts at ~0.71 on the diagonal (docs/decisions.md)


@dataclass
class MixtureSourceConfig:
    """One source of ``data.mixture`` (README "Data mixtures")."""

    path: str | None = None  # a dir made by msar-prepare-data (meta.json + tokenizer.json + token shards)
    weight: float = 1.0  # share of the training samples: weight / sum of the weights
    name: str | None = None  # metric suffix (data/tokens/<name>); default: the basename of `path`


@dataclass
class DataConfig:
    # built-in corpus (shakespeare | ptb) prepared into cache_dir when `path` is null
    corpus: str = "shakespeare"
    # directory made by msar-prepare-data (meta.json + tokenizer.json + token shards); null = use `corpus`
    path: str | None = None
    # built-in corpora, their prepared shards and the datasets cache; relative = under the repo root
    cache_dir: str = "${oc.env:MSAR_CACHE,.cache/msar}"
    tokenizer_vocab_size: int = 4096  # byte-level BPE trained for `corpus` (ignored with `path`)
    seq_len: int = 128
    val_fraction: float = 0.05  # documents carved off train for validation (corpus without a validation split)
    document_mask: bool = False  # attention and MSAR convs stay inside one document
    verify_checksums: bool = True  # sha256 every shard at open (turn off for huge, trusted data)
    num_proc: int = 2  # tokenizer processes when preparing `corpus`
    # refuse data tokenized with another tokenizer (sha256 of its tokenizer.json); null = no check
    expected_tokenizer_sha256: str | None = None
    # weighted mixture of prepared dirs (one tokenizer); non-empty = train on it instead of `path` /
    # `corpus` (data.path must then be null); validation is the same fixed mixture of their validation splits
    mixture: list[MixtureSourceConfig] = field(default_factory=list)


@dataclass
class EvalHarnessConfig:
    """lm-evaluation-harness tasks scored every ``trainer.eval_every`` steps (msar_train/export/harness.py;
    ``pip install 'msar-train[eval]'``). Off while ``tasks`` is empty."""

    tasks: list[str] = field(default_factory=list)  # lm-eval task names (hub tasks need hub access)
    include_path: str | None = None  # a dir of task YAMLs (python -m msar_train.export.harness DIR TEXT)
    limit: int | None = None  # documents per task (null: all)
    batch_size: int = 8


@dataclass
class TrainerConfig:
    max_steps: int = 200
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | wsd | constant
    wsd_decay_fraction: float = 0.2  # WSD: fraction of steps in the final decay
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = off
    eval_every: int = 50
    eval_batches: int = 8
    eval_harness: EvalHarnessConfig = field(default_factory=EvalHarnessConfig)
    log_every: int = 10
    seed: int = 1234
    run_dir: str | None = None  # default runs/<experiment>-<timestamp>
    progress: bool = True  # rich progress display
    threads: int | None = None  # torch.set_num_threads; null = leave as is
    # checkpoints (RUN_DIR/checkpoints/step<N>/, DeepSpeed format + our manifest.json)
    save_every: int = 100  # steps between checkpoints (one is always written at the end); 0 = only at the end
    keep_last: int = 3  # verified checkpoints kept; older ones are deleted after each save
    resume: str = "auto"  # auto (newest valid checkpoint in RUN_DIR/checkpoints, else fresh) | none | PATH
    # end this job after this step (checkpoint saved) without changing the schedule, which max_steps
    # defines: time-sliced jobs (e.g. SLURM time limits) run the same command with resume=auto
    stop_at: int | None = None
    max_consecutive_skips: int = 5  # a non-finite loss/grad skips the step; this many in a row stop the run
    # TEST HOOK: poison the loss with NaN at these (1-based) steps, to exercise step skipping
    debug_nan_steps: list[int] = field(default_factory=list)


@dataclass
class ParallelConfig:
    """How training is spread over ranks (DeepSpeed). Every run goes through ``deepspeed.initialize``."""

    pp_stages: int = 1  # pipeline stages (PipelineModule over Transformer.layers())
    ep_size: int = 1  # expert parallelism inside each stage's data-parallel group
    zero_stage: int = 0  # 0 | 1 | 2 (2 only without pipeline parallelism)
    micro_batch_size: int = 8  # per data-parallel rank
    grad_accum: int = 1  # micro-batches per optimizer step
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16
    activation_checkpointing: bool = False  # torch.utils.checkpoint (non-reentrant) per layer
    partition_method: str = "blocks"  # uniform | parameters | blocks (cuts on summary-block boundaries)
    virtual_stages: int = 1  # V chunks per pipeline rank (chunk c on rank c mod P), interleaved 1F1B when > 1
    summary_cache: bool = True  # V > 1: cross-stage cache of completed summaries (false: every hop sends all)
    dist_backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    dist_timeout_s: int = 300  # process-group timeout: a missing rank fails instead of hanging
    deepspeed_overrides: dict[str, Any] = field(default_factory=dict)  # raw DeepSpeed config keys, merged last


@dataclass
class MemoryConfig:
    """``msar-plan``'s memory estimate (``parallel/memory.py``)."""

    device_gib: float | None = None  # memory of one device; ranks whose estimated peak exceeds it are flagged; null = no check
    world_size: int | None = None  # ranks the estimate assumes (sets the data-parallel size); null = WORLD_SIZE, else pp_stages * ep_size


@dataclass
class LoggerConfig:
    mode: str = "offline"  # online | offline | disabled (wandb); JSONL is always written
    project: str = "msar-train"
    entity: str | None = None
    group: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    residual_every: int = 50  # steps between residual diagnostics (depth entropy, fusion weights, mHC); 0 = off
    heatmap_every: int = 100  # steps between depth-attention heatmap images; 0 = off
    peak_tflops: float | None = None  # per-device peak for MFU (GPU only); null = from the device name


@dataclass
class ExperimentConfig:
    name: str = "default"  # run dirs and, in a multirun, the sweep dir sweeps/<name>
    notes: str = ""
    # multirun: a compact record of every finished job is also written here (relative = under the repo
    # root), one JSON per job named from its overrides; a job whose record exists is skipped
    records_dir: str | None = None


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
