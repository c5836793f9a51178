"""``deepspeed.pipe.PipelineModule`` over the same ``Transformer.layers()`` recipe (no second model).

What crosses a stage boundary is the layer carry: ``(aux, [doc_ids, positions,] *residual_state)``,
a flat tuple of tensors (see ``model/layers.py``). Residual modules shared by several layers (MSAR's
per-source conv expansions) are replicated on every stage that reads them; their gradients are summed
over those stages exactly like DeepSpeed's tied layers, and only the first holder counts them in the
gradient norm.
"""

from __future__ import annotations

import deepspeed.comm as dist
import torch
from deepspeed.pipe import LayerSpec, PipelineModule

from msar_train.model.init import init_layer_
from msar_train.model.recompute import checkpoint
from msar_train.model.transformer import layer_specs, lm_loss
from msar_train.parallel.partition import partition


class LossFn:
    """Pipeline loss: returns CE + aux for backward and keeps the CE values for metrics."""

    __name__ = "lm_loss"

    def __init__(self):
        self.ce: list[torch.Tensor] = []

    def __call__(self, outputs, labels_BT: torch.Tensor) -> torch.Tensor:
        total, ce = lm_loss(outputs, labels_BT)
        self.ce.append(ce.detach())
        return total

    def pop_mean(self) -> float | None:
        if not self.ce:
            return None
        out = float(torch.stack(self.ce).mean())
        self.ce = []
        return out


class MSARPipelineModule(PipelineModule):
    def __init__(self, cfg, backend, loss_fn: LossFn, topology=None):
        self.backend = backend
        self._parts_override = partition(cfg.model, cfg.residual, cfg.parallel.pp_stages, cfg.parallel.partition_method)
        specs = [LayerSpec(cls, *args) for cls, args in layer_specs(cfg.model, backend, cfg.data.document_mask)]
        super().__init__(
            specs,
            num_stages=None if topology is not None else cfg.parallel.pp_stages,
            topology=topology,
            loss_fn=loss_fn,
            partition_method="uniform",  # replaced by _parts_override in _partition_layers
            activation_checkpoint_interval=1 if cfg.parallel.activation_checkpointing else 0,
            activation_checkpoint_func=checkpoint,  # non-reentrant: tuple carries
        )
        for local_idx, layer in enumerate(self.forward_funcs):
            init_layer_(layer, cfg.trainer.seed, local_idx + self._local_start, cfg.model.init_std)
        self.shared_comms = self._index_shared_modules()
        self._broadcast_shared()

    def _partition_layers(self, method="uniform"):
        self.parts = list(self._parts_override)
        self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    def _index_shared_modules(self) -> list[tuple[torch.nn.Module, object, list[int]]]:
        """Process groups over the stages that hold each shared module (one per data-parallel fiber)."""
        local = {k: m for k, m in self.backend.shared_modules().items() if any(True for _ in m.parameters())}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self.stage_id, sorted(local)))
        holders: dict[str, set[int]] = {}
        for stage, keys in everyone:
            for k in keys:
                holders.setdefault(k, set()).add(stage)
        comms = []
        for key in sorted(holders):
            stages = sorted(holders[key])
            if len(stages) < 2:
                continue
            for dp in range(self._grid.data_parallel_size):
                ranks = [self._grid.stage_to_global(stage_id=s, data=dp) for s in stages]
                group = dist.new_group(ranks=ranks)
                if self.global_rank in ranks:
                    module = local[key]
                    comms.append((module, group, ranks))
                    if self.global_rank != ranks[0]:
                        for p in module.parameters():
                            p.ds_pipe_replicated = True  # counted once in the global grad norm
        return comms

    def _broadcast_shared(self) -> None:
        for module, group, ranks in self.shared_comms:
            for p in module.parameters():
                dist.broadcast(p.data, src=ranks[0], group=group)

    def get_tied_weights_and_groups(self):
        pairs = super().get_tied_weights_and_groups()
        for module, group, _ in self.shared_comms:
            pairs.extend((p, group) for p in module.parameters())
        return pairs

    def allreduce_tied_weight_gradients(self):
        super().allreduce_tied_weight_gradients()
        for module, group, _ in self.shared_comms:
            for p in module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=group)

    def load_state_dir(self, load_dir, checkpoint_engine, strict=True):
        super().load_state_dir(load_dir, checkpoint_engine, strict=strict)
        self._broadcast_shared()
