"""Multi-Stream Attention Residuals: Block (``n_blocks = N``) and Full (``null``) MSAR.

Each source is expanded into ``num_streams`` streams (identity + causal depthwise convs with the
configured ``kernel_sizes``), each stream is a depth-attention head, and the per-stream outputs are
fused (``adaptive``: mHC-style sigmoid gates; ``mean``). Ablations: ``expansion: none`` (identical
copies), any ``num_streams`` with one kernel size per extra stream.
"""

from msar_train.residual.base import register
from msar_train.residual.depth import DepthBackend


@register
class MSARBackend(DepthBackend):
    name = "msar"

    def __init__(self, cfg, n_layers: int, d_model: int, norm_eps: float, init_std: float):
        self.num_streams = cfg.num_streams
        self.kernel_sizes = list(cfg.kernel_sizes)
        self.fusion = cfg.fusion
        self.conv = cfg.expansion == "conv" and cfg.num_streams > 1
        super().__init__(cfg, n_layers, d_model, norm_eps, init_std)
