"""``msar-params [hydra overrides]``: total and active parameter counts, on the meta device (no weights).

Example: ``msar-params model=moe_10b residual=msar`` prints one JSON object
``{"total_params": ..., "active_params": ..., "residual_params": ...}``; exit status 2 on a bad override.

Active = total minus, in every MoE layer, the routed experts a token does not use
(``n_routed - top_k`` of them). Embedding and LM head count in both (once when tied).
"""

from __future__ import annotations

import json
import sys

import torch


def count_params(cfg) -> dict[str, int]:
    from msar_train.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.residual, document_mask=False)
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for moe in model.moe_layers():
        per_expert = sum(p.numel() for p in moe.experts[0].parameters())
        inactive += (len(moe.experts) - cfg.model.moe.top_k) * per_expert
    residual = sum(p.numel() for n, p in model.named_parameters() if "_site." in n or n.startswith(("head.exit.", "embed.entry.")))
    return {"total_params": total, "active_params": total - inactive, "residual_params": residual}


def main(argv: list[str] | None = None) -> int:
    from msar_train.config import compose_config

    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(__doc__)
        return 0
    try:
        cfg = compose_config(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"msar-params: {e}", file=sys.stderr)
        return 2
    print(json.dumps(count_params(cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
