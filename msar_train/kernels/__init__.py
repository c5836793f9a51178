"""Depth-attention implementations (torch reference path; fused paths are chosen by config)."""
