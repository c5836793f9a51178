"""msar-train: DeepSeekMoE pretraining with pluggable residual backends (MSAR, AttnRes, mHC, vanilla)."""

__version__ = "0.1.0"
