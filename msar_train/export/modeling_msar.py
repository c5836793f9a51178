"""``MsarForCausalLM``: a ``transformers`` causal LM around msar-train's own ``Transformer`` (remote code).

This file is copied verbatim into every folder ``msar-export`` writes (``modeling_msar.py``) and
loaded from there by ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``. It holds no
model math: the forward is the installed ``msar_train`` package's ``Transformer`` (the fold over
``Transformer.layers()`` that training runs), so the exported model cannot drift from the trained one
(docs/decisions.md "Hugging Face export"). The package's version is checked against the one that
wrote the folder (``config.msar_version``): a different version warns, a missing package raises.

Parameter names: ``model.<Transformer name>`` (``model.blocks.2.attn.wq.weight``). MSAR's source
expansions are one parameter reached from several sites; the folder stores every alias and
``tie_weights`` makes them one parameter again after loading (and moves weights read at unaligned
file offsets into fresh storage: in fp32 on the CPU the logits are then bitwise the training model's).

Generation (``model.generate``) is cached: the first forward of a sequence creates a
``msar_train.model.cache.DecodeCache`` (attention keys/values; for MSAR the last ``max(kernel_sizes) -
1`` positions of every source its convolutions read), returns it as ``outputs.cache``, and every later
forward reads only the new token through ``Transformer.decode``. ``use_cache=False`` recomputes the
whole prefix instead (same logits within fp32 rounding). Batches may be left-padded: ``attention_mask``
zeros make the padding a document of its own (no attention and no convolution reads it from a real
token) and positions count real tokens only. Logits processors, sampling, beam search and stopping are
``transformers``' own.

Legend: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_msar import MsarConfig

try:
    import msar_train
    from msar_train.config.schema import ModelConfig, MoEConfig, ResidualConfig
    from msar_train.model.cache import DecodeCache
    from msar_train.model.moe import MoE
    from msar_train.model.transformer import Transformer
except ImportError as e:  # pragma: no cover - exercised only without the package
    raise ImportError(
        "this model was exported by msar-train and computes with its installed package `msar_train` "
        f"(pip install msar-train, the version named by msar_version in config.json): {e}"
    ) from e


def build_transformer(config: MsarConfig) -> Transformer:
    """The training ``Transformer`` of ``config`` (weights initialised; ``from_pretrained`` loads them)."""
    m = dict(config.msar_model)
    try:
        model_cfg = ModelConfig(**{**m, "moe": MoEConfig(**m.get("moe", {}))})
        residual_cfg = ResidualConfig(**config.msar_residual)
    except TypeError as e:
        raise ValueError(
            f"config.json names a field this msar_train {msar_train.__version__} does not know ({e}); "
            f"install msar_train {config.msar_version} (the version that exported it)"
        ) from None
    return Transformer(model_cfg, residual_cfg, document_mask=config.document_mask, seed=0)


class MsarPreTrainedModel(PreTrainedModel):
    config_class = MsarConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _supports_cache_class = False
    _no_split_modules = ["Block"]

    def _init_weights(self, module: torch.nn.Module) -> None:
        # Every parameter comes from model.safetensors; only MoE's transient load counter is not saved.
        if isinstance(module, MoE):
            module.load_counts.zero_()


class MsarForCausalLM(MsarPreTrainedModel, GenerationMixin):
    def __init__(self, config: MsarConfig):
        super().__init__(config)
        if config.msar_version and config.msar_version != msar_train.__version__:
            warnings.warn(
                f"this folder was exported by msar_train {config.msar_version}, the installed package is "
                f"{msar_train.__version__}: the model math may differ",
                stacklevel=2,
            )
        self.model = build_transformer(config)
        # Parameters reached under several names (MSAR source expansions): restored by tie_weights.
        groups: dict[int, list[str]] = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
        self._aliases = [names for names in groups.values() if len(names) > 1]
        self.post_init()

    def tie_weights(self, *args, **kwargs) -> None:
        # from_pretrained calls this once the weights are in. Tensors read from a safetensors file sit
        # at arbitrary byte offsets, and CPU matmul kernels round differently on unaligned memory
        # (~1e-7 relative); a copy into fresh storage makes the logits bitwise the training model's.
        with torch.no_grad():
            for p in self.parameters():
                if p.device.type == "cpu" and p.data_ptr() % 64:
                    p.data = p.data.clone()
        super().tie_weights(*args, **kwargs)
        for first, *others in getattr(self, "_aliases", []):
            shared = self.get_parameter(first)
            for name in others:
                owner, _, attr = name.rpartition(".")
                setattr(self.get_submodule(owner), attr, shared)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed.tok

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is ours (DecodeCache): forward creates it on a sequence's first call

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        cache: DecodeCache | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``logits_BTV`` of ``input_ids``; with ``labels`` (the input ids: shifted here, -100 ignored)
        the mean next-token cross-entropy as ``loss`` (the MoE balance loss is not part of it).

        ``attention_mask`` [B, cached + T] (1 = token, 0 = padding) may mark left padding. With
        ``use_cache=True`` (``generate`` passes ``generation_config.use_cache``) or a ``cache``,
        ``input_ids`` are the tokens after those the cache holds and the returned ``cache`` holds them
        too. A plain call (no cache, no padding) is the training model's own forward, bitwise."""
        if input_ids is None:
            raise ValueError("MsarForCausalLM needs input_ids (inputs_embeds are not supported)")
        ids_BT = input_ids
        B, T = ids_BT.shape
        use_cache = bool(use_cache)
        padded = attention_mask is not None and not bool(attention_mask.all())
        if cache is not None or use_cache or padded:
            past = 0 if cache is None else cache.get_seq_length()
            if attention_mask is None:
                attention_mask = torch.ones(B, past + T, dtype=torch.long, device=ids_BT.device)
            if attention_mask.shape != (B, past + T):
                raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(B, past + T)} (cached + new tokens)")
            mask_BS = attention_mask.long()
            positions_BT = (mask_BS.cumsum(1) - 1).clamp_min(0)[:, -T:]
            step_cache = DecodeCache() if cache is None else cache
            logits_BTV, _ = self.model.decode(ids_BT, step_cache, mask_BS[:, -T:], positions_BT)
            cache = step_cache if (use_cache or cache is not None) else None
        elif self.config.document_mask:  # one document per row
            positions_BT = torch.arange(T, device=ids_BT.device).expand(B, T)
            logits_BTV, _ = self.model(ids_BT, torch.zeros_like(ids_BT), positions_BT)
        else:
            logits_BTV, _ = self.model(ids_BT)
        loss = None
        if labels is not None:
            shift_BTV = logits_BTV[:, :-1].float()
            loss = F.cross_entropy(shift_BTV.reshape(-1, shift_BTV.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits_BTV, cache=cache)
