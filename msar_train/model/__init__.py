"""Pure-PyTorch DeepSeekMoE Transformer built as a list of pipeline-ready layers (no DeepSpeed here)."""
