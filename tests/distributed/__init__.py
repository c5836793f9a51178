"""Multi-process tests (torchrun over gloo on CPU)."""
