"""``MsarConfig``: the ``transformers`` config of an exported msar-train model (remote code).

This file is copied verbatim into every folder ``msar-export`` writes (``configuration_msar.py``) and
loaded from there by ``AutoConfig.from_pretrained(dir, trust_remote_code=True)``. It needs only
``transformers``: the model math lives in the installed ``msar_train`` package (``modeling_msar.py``).

Round trip: ``msar_model`` / ``msar_residual`` hold every field of the training run's ``cfg.model``
(``moe`` nested) and ``cfg.residual``, ``document_mask`` the run's ``data.document_mask``; the usual
Hugging Face names (``vocab_size``, ``hidden_size``, ...) are read-only copies for tools that look
for them. ``msar_version`` / ``msar_git_commit``: the package that wrote the folder; ``train_git_commit``:
the checkout that trained it.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class MsarConfig(PretrainedConfig):
    model_type = "msar"

    def __init__(
        self,
        msar_model: dict[str, Any] | None = None,
        msar_residual: dict[str, Any] | None = None,
        document_mask: bool = False,
        msar_version: str | None = None,
        msar_git_commit: str | None = None,
        train_git_commit: str | None = None,
        use_cache: bool = True,
        **kwargs: Any,
    ):
        self.msar_model = dict(msar_model or {})
        self.msar_residual = dict(msar_residual or {})
        self.document_mask = bool(document_mask)
        self.msar_version = msar_version
        self.msar_git_commit = msar_git_commit
        self.train_git_commit = train_git_commit
        self.use_cache = bool(use_cache)  # generate with a DecodeCache (modeling_msar.py)
        m = self.msar_model
        for hf_name, ours in (
            ("vocab_size", "vocab_size"),
            ("hidden_size", "d_model"),
            ("num_hidden_layers", "n_layers"),
            ("num_attention_heads", "n_heads"),
            ("num_key_value_heads", "n_kv_heads"),
            ("max_position_embeddings", "max_seq_len"),
            ("rms_norm_eps", "norm_eps"),
            ("rope_theta", "rope_theta"),
        ):
            if ours in m:
                kwargs.pop(hf_name, None)
                setattr(self, hf_name, m[ours])
        kwargs.pop("tie_word_embeddings", None)
        super().__init__(tie_word_embeddings=bool(m.get("tie_embeddings", False)), **kwargs)
