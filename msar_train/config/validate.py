"""Cross-field validation: every failure is a ``ValueError`` that names the offending field."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from msar_train.config.schema import TrainConfig
from msar_train.errors import ConfigError


def _fail(field: str, value, why: str) -> None:
    raise ConfigError(f"{field}={value!r}: {why}")


def _choice(field: str, value, choices) -> None:
    if value not in choices:
        _fail(field, value, f"must be one of {sorted(choices)}")


def _positive(cfg_node, prefix: str, names: list[str]) -> None:
    for n in names:
        v = cfg_node[n]
        if v is not None and v <= 0:
            _fail(f"{prefix}.{n}", v, "must be > 0")


def validate_model(m: DictConfig) -> None:
    _positive(
        m, "model", ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "max_seq_len", "dense_hidden", "init_std", "rope_theta"]
    )
    if m.n_heads % m.n_kv_heads:
        _fail("model.n_kv_heads", m.n_kv_heads, f"must divide model.n_heads={m.n_heads}")
    head_dim = m.head_dim or m.d_model // m.n_heads
    if m.head_dim is None and m.d_model % m.n_heads:
        _fail("model.n_heads", m.n_heads, f"must divide model.d_model={m.d_model} (or set model.head_dim)")
    if head_dim % 2:
        _fail("model.head_dim", head_dim, "must be even (RoPE rotates pairs)")
    if not 0 <= m.first_k_dense <= m.n_layers:
        _fail("model.first_k_dense", m.first_k_dense, f"must be in [0, model.n_layers={m.n_layers}]")
    e = m.moe
    _positive(e, "model.moe", ["n_routed", "top_k", "expert_hidden", "n_group", "topk_group", "routed_scaling_factor"])
    if e.n_shared < 0:
        _fail("model.moe.n_shared", e.n_shared, "must be >= 0")
    _choice("model.moe.score_func", e.score_func, {"softmax", "sigmoid"})
    if e.top_k > e.n_routed:
        _fail("model.moe.top_k", e.top_k, f"must be <= model.moe.n_routed={e.n_routed}")
    if e.n_routed % e.n_group:
        _fail("model.moe.n_group", e.n_group, f"must divide model.moe.n_routed={e.n_routed}")
    if e.topk_group > e.n_group:
        _fail("model.moe.topk_group", e.topk_group, f"must be <= model.moe.n_group={e.n_group}")
    if e.top_k > e.topk_group * (e.n_routed // e.n_group):
        _fail("model.moe.top_k", e.top_k, "exceeds the experts inside the topk_group chosen groups")
    for n in ("aux_loss_coef", "seq_aux_loss_coef", "bias_update_rate"):
        if e[n] < 0:
            _fail(f"model.moe.{n}", e[n], "must be >= 0")


def validate_residual(r: DictConfig, n_layers: int) -> None:
    _choice("residual.name", r.name, {"vanilla", "mhc", "attnres", "msar"})
    n_branches = 2 * n_layers
    if r.n_blocks is not None and not 1 <= r.n_blocks <= n_branches:
        _fail("residual.n_blocks", r.n_blocks, f"must be in [1, {n_branches}] (2 * model.n_layers branches) or null (Full)")
    _choice("residual.fusion", r.fusion, {"adaptive", "mean"})
    _choice("residual.expansion", r.expansion, {"conv", "none"})
    _choice("residual.kernel", r.kernel, {"torch", "triton", "compile"})
    if r.num_streams < 1:
        _fail("residual.num_streams", r.num_streams, "must be >= 1")
    if r.name == "msar" and r.expansion == "conv" and len(r.kernel_sizes) != r.num_streams - 1:
        _fail(
            "residual.kernel_sizes",
            list(r.kernel_sizes),
            f"needs one size per extra stream: {r.num_streams - 1} for residual.num_streams={r.num_streams}",
        )
    for k in r.kernel_sizes:
        if k < 1:
            _fail("residual.kernel_sizes", list(r.kernel_sizes), "every kernel size must be >= 1")
    if not 0.0 <= r.conv_init_smoothing <= 1.0:
        _fail("residual.conv_init_smoothing", r.conv_init_smoothing, "must be in [0, 1] (0 = identity taps, 1 = moving average)")
    if r.mhc_streams < 1:
        _fail("residual.mhc_streams", r.mhc_streams, "must be >= 1")
    if r.sinkhorn_iters < 1:
        _fail("residual.sinkhorn_iters", r.sinkhorn_iters, "must be >= 1")


def validate_trainer(t: DictConfig) -> None:
    _positive(t, "trainer", ["max_steps", "lr", "eval_every", "eval_batches", "log_every"])
    if t.warmup_steps < 0:
        _fail("trainer.warmup_steps", t.warmup_steps, "must be >= 0")
    _choice("trainer.schedule", t.schedule, {"cosine", "wsd", "constant"})
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        _fail("trainer.min_lr_ratio", t.min_lr_ratio, "must be in [0, 1]")
    if not 0.0 < t.wsd_decay_fraction <= 1.0:
        _fail("trainer.wsd_decay_fraction", t.wsd_decay_fraction, "must be in (0, 1]")
    if t.grad_clip < 0:
        _fail("trainer.grad_clip", t.grad_clip, "must be >= 0 (0 disables clipping)")
    if t.save_every < 0:
        _fail("trainer.save_every", t.save_every, "must be >= 0 (0 = save only at the end)")
    _positive(t, "trainer", ["keep_last", "max_consecutive_skips"])
    if t.stop_at is not None and not 0 < t.stop_at <= t.max_steps:
        _fail("trainer.stop_at", t.stop_at, f"must be null or a step in 1..trainer.max_steps={t.max_steps}")
    if not str(t.resume).strip():
        _fail("trainer.resume", t.resume, "must be auto, none or a checkpoint path")
    for s in t.debug_nan_steps:
        if not isinstance(s, int) or s < 1:
            _fail("trainer.debug_nan_steps", list(t.debug_nan_steps), "must list step numbers >= 1")
    validate_eval_harness(t.eval_harness)


def validate_eval_harness(h: DictConfig) -> None:
    if not h.tasks:
        return
    for name in h.tasks:
        if not isinstance(name, str) or not name.strip():
            _fail("trainer.eval_harness.tasks", list(h.tasks), "must list lm-eval task names")
    if h.include_path is not None and not Path(str(h.include_path)).expanduser().is_dir():
        _fail("trainer.eval_harness.include_path", h.include_path, "is not a directory (of lm-eval task YAMLs)")
    if h.limit is not None and h.limit < 1:
        _fail("trainer.eval_harness.limit", h.limit, "must be null or >= 1")
    if h.batch_size < 1:
        _fail("trainer.eval_harness.batch_size", h.batch_size, "must be >= 1")
    if importlib.util.find_spec("lm_eval") is None:
        _fail("trainer.eval_harness.tasks", list(h.tasks), "needs lm-evaluation-harness: pip install 'msar-train[eval]'")


def validate_logger(lg: DictConfig) -> None:
    _choice("logger.mode", lg.mode, {"online", "offline", "disabled"})
    for n in ("residual_every", "heatmap_every"):
        if lg[n] < 0:
            _fail(f"logger.{n}", lg[n], "must be >= 0 (0 = off)")
    if lg.peak_tflops is not None and lg.peak_tflops <= 0:
        _fail("logger.peak_tflops", lg.peak_tflops, "must be > 0 or null")


def validate_memory(mem: DictConfig, p: DictConfig) -> None:
    if mem.device_gib is not None and not mem.device_gib > 0:
        _fail("memory.device_gib", mem.device_gib, "must be > 0 (GiB of one device) or null (no check)")
    if mem.world_size is not None:
        if mem.world_size <= 0:
            _fail("memory.world_size", mem.world_size, "must be > 0 or null")
        if mem.world_size % p.pp_stages or (mem.world_size // p.pp_stages) % p.ep_size:
            _fail(
                "memory.world_size",
                mem.world_size,
                f"must be a multiple of parallel.pp_stages={p.pp_stages} whose quotient (the data-parallel size) "
                f"parallel.ep_size={p.ep_size} divides",
            )


def _chunk_cut_points(cfg: DictConfig) -> int:
    """Places a pipeline chunk boundary may go: after the embedding or after any block, and with
    ``partition_method=blocks`` for depth-attention backends only where no partial summary is open
    (the block split of ``residual/layout.py``: sizes differ by at most one, longer blocks first)."""
    n = cfg.model.n_layers
    r = cfg.residual
    if cfg.parallel.partition_method != "blocks" or r.name not in ("attnres", "msar"):
        return n + 1
    L = 2 * n
    N = L if r.n_blocks is None else r.n_blocks
    base, extra = divmod(L, N)
    ends, end = set(), 0
    for b in range(N):
        end += base + (1 if b < extra else 0)
        ends.add(end)
    return 1 + sum(1 for a in range(1, n + 1) if 2 * a in ends)


def validate_pipeline_layout(p: DictConfig, cfg: DictConfig) -> None:
    """Can ``parallel.pp_stages * parallel.virtual_stages`` non-empty chunks be cut from the model?
    The one check of the layout that both ``msar-train`` (at compose time) and ``msar-plan`` make:
    the partitioner (``parallel/partition.py``) succeeds exactly when the model has enough cut points."""
    V, P = p.virtual_stages, p.pp_stages
    if V < 1:
        _fail("parallel.virtual_stages", V, "must be >= 1")
    if V > 1 and P < 2:
        _fail("parallel.virtual_stages", V, "needs parallel.pp_stages >= 2 (the chunks interleave over pipeline ranks)")
    if P * V == 1:
        return
    cuts = _chunk_cut_points(cfg)
    if P * V - 1 > cuts:
        field, value = ("parallel.virtual_stages", V) if V > 1 else ("parallel.pp_stages", P)
        blocks = ""
        if cuts < cfg.model.n_layers + 1:
            blocks = f", residual.n_blocks={cfg.residual.n_blocks}: a cut must fall between residual blocks"
        _fail(
            field,
            value,
            f"{P}*{V}={P * V} pipeline chunks need {P * V - 1} cuts but the model allows {cuts} "
            f"(model.n_layers={cfg.model.n_layers}, parallel.partition_method={p.partition_method}{blocks}); "
            "use fewer virtual or pipeline stages, more residual.n_blocks, or partition_method=parameters",
        )


def validate_parallel(p: DictConfig, cfg: DictConfig, world_size: int | None) -> None:
    """``world_size``: known from the launcher's WORLD_SIZE at compose time, else checked again at start."""
    _positive(p, "parallel", ["pp_stages", "ep_size", "micro_batch_size", "grad_accum", "dist_timeout_s"])
    _choice("parallel.dtype", p.dtype, {"auto", "float32", "bfloat16"})
    _choice("parallel.dist_backend", p.dist_backend, {"auto", "gloo", "nccl"})
    _choice("parallel.partition_method", p.partition_method, {"uniform", "parameters", "blocks"})
    _choice("parallel.zero_stage", p.zero_stage, {0, 1, 2})
    n_layers = cfg.model.n_layers
    if p.pp_stages > n_layers:
        _fail("parallel.pp_stages", p.pp_stages, f"must be <= model.n_layers={n_layers} (every stage needs a block)")
    if p.pp_stages > 1 and p.zero_stage >= 2:
        _fail("parallel.zero_stage", p.zero_stage, "ZeRO-2/3 partition gradients, which pipeline parallelism does not support: use 0 or 1")
    if p.pp_stages > 1 and cfg.model.tie_embeddings:
        _fail(
            "model.tie_embeddings", True, "tied embeddings across pipeline stages are not supported; untie them or use parallel.pp_stages=1"
        )
    validate_pipeline_layout(p, cfg)
    if cfg.model.moe.n_routed % p.ep_size:
        _fail("parallel.ep_size", p.ep_size, f"must divide model.moe.n_routed={cfg.model.moe.n_routed}")
    if p.ep_size > 1 and cfg.model.first_k_dense >= n_layers:
        _fail("parallel.ep_size", p.ep_size, "the model has no MoE layer (model.first_k_dense >= model.n_layers)")
    if world_size is not None:
        validate_world(p, world_size)
    ov = p.deepspeed_overrides
    if "train_micro_batch_size_per_gpu" in ov and ov["train_micro_batch_size_per_gpu"] != p.micro_batch_size:
        _fail(
            "parallel.deepspeed_overrides.train_micro_batch_size_per_gpu",
            ov["train_micro_batch_size_per_gpu"],
            f"disagrees with parallel.micro_batch_size={p.micro_batch_size}",
        )
    if "gradient_accumulation_steps" in ov and ov["gradient_accumulation_steps"] != p.grad_accum:
        _fail(
            "parallel.deepspeed_overrides.gradient_accumulation_steps",
            ov["gradient_accumulation_steps"],
            f"disagrees with parallel.grad_accum={p.grad_accum}",
        )
    tb = ov.get("train_batch_size")
    if tb is not None and (not isinstance(tb, int) or tb <= 0 or tb % (p.micro_batch_size * p.grad_accum)):
        _fail(
            "parallel.deepspeed_overrides.train_batch_size",
            tb,
            "must be parallel.micro_batch_size * parallel.grad_accum * data-parallel size, "
            f"a multiple of {p.micro_batch_size}*{p.grad_accum}",
        )


def validate_world(p: DictConfig, world_size: int) -> None:
    """Checks that need the number of ranks."""
    if world_size % p.pp_stages:
        _fail("parallel.pp_stages", p.pp_stages, f"must divide the world size {world_size}")
    dp = world_size // p.pp_stages
    if dp % p.ep_size:
        _fail(
            "parallel.ep_size",
            p.ep_size,
            f"must divide the data-parallel size {dp} (= world {world_size} / parallel.pp_stages {p.pp_stages})",
        )
    tb = p.deepspeed_overrides.get("train_batch_size") if p.deepspeed_overrides else None
    if tb is not None and tb != p.micro_batch_size * p.grad_accum * dp:
        _fail(
            "parallel.deepspeed_overrides.train_batch_size",
            tb,
            f"must equal parallel.micro_batch_size * parallel.grad_accum * data-parallel size = {p.micro_batch_size}*{p.grad_accum}*{dp}",
        )


def mixture_entries(mixture, path=None) -> list[tuple[str, str, float]]:
    """``data.mixture`` -> ``[(name, path, weight)]``, or a ``ConfigError`` naming the entry's field.

    Each entry needs a path and a weight that is a finite number >= 0, the weights must sum to > 0,
    and the names (default: the path's basename) must be unique: they name the ``data/tokens/<name>``
    metrics. ``path`` is ``data.path``, which must be unset when a mixture is given. Pure (no file
    access): run at compose time and again when the data is built (``data/mixture.py``).
    """
    if path not in (None, "???", ""):
        _fail("data.path", path, "must be null when data.mixture is given (the mixture names its own dirs)")
    out: list[tuple[str, str, float]] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(mixture):
        at = f"data.mixture[{i}]"
        get = entry.get if hasattr(entry, "get") else lambda k, e=entry: getattr(e, k, None)
        p, w, name = get("path"), get("weight"), get("name")
        if p is None or not str(p).strip():
            _fail(f"{at}.path", p, "every mixture source needs the path of a dir made by msar-prepare-data")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            _fail(f"{at}.weight", w, "must be a finite number >= 0")
        if w < 0:
            _fail(f"{at}.weight", w, "must be >= 0")
        name = str(name) if name is not None else os.path.basename(os.path.normpath(os.path.expanduser(str(p))))
        if not name or "/" in name:
            _fail(f"{at}.name", name, "must be a non-empty name without '/' (it is the metric suffix data/tokens/<name>)")
        if name in seen:
            _fail(f"{at}.name", name, f"is also the name of data.mixture[{seen[name]}]: names must be unique (set data.mixture[{i}].name)")
        seen[name] = i
        out.append((name, str(p), float(w)))
    total = sum(w for _, _, w in out)
    if out and not total > 0:
        _fail("data.mixture[*].weight", [w for _, _, w in out], "the weights must sum to a positive number")
    return out


def check_known_keys(node: DictConfig, schema: type, prefix: str = "") -> None:
    """Hydra's ``+key=value`` can append keys the schema does not know; refuse them by name."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node.keys():
        name = f"{prefix}{key}"
        if key not in fields:
            raise ValueError(f"{name}: unknown config key (not a field of {schema.__name__})")
        sub = fields[key].default_factory if fields[key].default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub) and isinstance(node[key], DictConfig):
            check_known_keys(node[key], sub, name + ".")


def validate(cfg: DictConfig) -> None:
    check_known_keys(cfg, TrainConfig)
    world = os.environ.get("WORLD_SIZE")
    validate_model(cfg.model)
    validate_residual(cfg.residual, cfg.model.n_layers)
    validate_trainer(cfg.trainer)
    validate_parallel(cfg.parallel, cfg, int(world) if world else None)
    if cfg.data.seq_len > cfg.model.max_seq_len:
        _fail("data.seq_len", cfg.data.seq_len, f"must be <= model.max_seq_len={cfg.model.max_seq_len}")
    if cfg.data.get("mixture"):
        mixture_entries(cfg.data.mixture, None if OmegaConf.is_missing(cfg.data, "path") else cfg.data.path)
    validate_logger(cfg.logger)
    validate_memory(cfg.memory, cfg.parallel)
    if cfg.trainer.eval_harness.tasks and (cfg.parallel.pp_stages > 1 or cfg.parallel.ep_size > 1):
        _fail(
            "trainer.eval_harness.tasks",
            list(cfg.trainer.eval_harness.tasks),
            "runs on a whole model: needs parallel.pp_stages=1 and parallel.ep_size=1 "
            f"(got {cfg.parallel.pp_stages}, {cfg.parallel.ep_size}); score checkpoints with msar-export + lm_eval instead",
        )
