"""Attention Residuals (Kimi Team, arXiv 2603.15031): Block (``n_blocks = N``) and Full (``null``).

One stream, no expansion, values are the raw sources: the depth-attention machinery of
``depth.py`` with M = 1 and mean fusion (which is the identity for one stream).
"""

from msar_train.residual.base import register
from msar_train.residual.depth import DepthBackend


@register
class AttnResBackend(DepthBackend):
    name = "attnres"
    num_streams = 1
    kernel_sizes: list[int] = []
    fusion = "mean"
    conv = False
