"""Interleaved 1F1B (Megatron's schedule with V virtual stages per rank) as a DeepSpeed ``PipeSchedule``.

Chunk ``c`` (0..C-1, ``C = P V``) runs on rank ``c mod P``; local chunk ``v`` of rank ``r`` is global
chunk ``v P + r``. The per-rank order of forward/backward computations follows Megatron's interleaved
1F1B with micro-batch groups of size P (the pre-2024 rule, for ``M mod P == 0``; other M run all forwards
then all backwards, ``train_order``): virtual
micro-batch ``k`` runs chunk ``(k mod PV) div P`` (reversed for backward) on micro-batch
``(k div PV) P + k mod P``; warm-up is ``2 (P - r - 1) + (V - 1) P`` forwards, everything when M == P.

Sends are asynchronous and every receive waits right before the computation that needs it, so the
schedule is deadlock-free iff the per-rank orders admit a global execution order; ``check_feasible``
simulates that and the schedule refuses orders that would hang. Messages are matched by tag (hop,
micro-batch, direction, tensor), so the order in which two ranks post them does not matter.

Legend: P pipeline ranks, V chunks per rank, C chunks, M micro-batches per step.
"""

from __future__ import annotations

from deepspeed.runtime.pipe import schedule as ds_schedule

Action = tuple[str, int, int]  # ("F" | "B", micro_batch, global chunk)


def train_order(P: int, V: int, M: int, rank: int) -> list[Action]:
    """Megatron's interleaved 1F1B compute order on ``rank``; when ``M`` is not a multiple of ``P``,
    all forwards then all backwards (every micro-batch through chunk v before chunk v + 1; backward in
    reverse), which is correct for any M but keeps all M V activations alive."""
    if M % P:
        forward = [("F", m, v * P + rank) for v in range(V) for m in range(M)]
        return forward + [("B", m, v * P + rank) for v in reversed(range(V)) for m in range(M)]
    total = M * V

    def chunk(k: int, forward: bool) -> int:
        v = (k % (P * V)) // P
        return (v if forward else V - 1 - v) * P + rank

    def mb(k: int) -> int:
        return (k // (P * V)) * P + k % P

    warm = total if M == P else min(2 * (P - rank - 1) + (V - 1) * P, total)
    order: list[Action] = [("F", mb(k), chunk(k, True)) for k in range(warm)]
    for i in range(total - warm):
        order += [("F", mb(warm + i), chunk(warm + i, True)), ("B", mb(i), chunk(i, False))]
    order += [("B", mb(i), chunk(i, False)) for i in range(total - warm, total)]
    return order


def inference_order(P: int, V: int, M: int, rank: int) -> list[Action]:
    """Forward only, any M: micro-batch by micro-batch, chunks in order (no backward to interleave)."""
    return [("F", m, v * P + rank) for m in range(M) for v in range(V)]


def check_feasible(orders: dict[int, list[Action]], P: int, V: int) -> None:
    """Simulate the ranks with asynchronous sends and blocking receives; raise if they would hang."""
    C = P * V
    done: set[Action] = set()
    pos = dict.fromkeys(orders, 0)
    progress = True
    while progress:
        progress = False
        for r, order in orders.items():
            while pos[r] < len(order):
                kind, m, c = order[pos[r]]
                if kind == "F":
                    ready = c == 0 or ("F", m, c - 1) in done
                else:
                    ready = ("F", m, c) in done and (c == C - 1 or ("B", m, c + 1) in done)
                if not ready:
                    break
                done.add(order[pos[r]])
                pos[r] += 1
                progress = True
    stuck = {r: orders[r][pos[r]] for r in orders if pos[r] < len(orders[r])}
    if stuck:
        raise RuntimeError(f"interleaved schedule would deadlock (P={P}, V={V}); ranks waiting at {stuck}")


class WaitSends(ds_schedule.PipeInstruction):
    """Wait for this rank's outstanding asynchronous sends (before gradients are reduced)."""


class InterleavedSchedule(ds_schedule.PipeSchedule):
    """Instruction stream of one rank. Buffer slot of (micro-batch m, local chunk v) = ``v M + m``.

    Per computation: forward = [LoadMicroBatch on chunk 0 / loss chunk] [RecvActivation] ForwardPass
    [SendActivation]; backward = [RecvGrad] BackwardPass [SendGrad]; then WaitSends, ReduceTiedGrads,
    ReduceGrads, OptimizerStep (training). Every instruction carries ``chunk`` and ``micro_batch``.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int, virtual_stages: int, train: bool = True):
        super().__init__(micro_batches, stages, stage_id)
        self.virtual_stages = virtual_stages
        self.train = train
        P, V, M = stages, virtual_stages, micro_batches
        order_fn = train_order if train else inference_order
        orders = {r: order_fn(P, V, M, r) for r in range(P)}
        check_feasible(orders, P, V)
        self.order = orders[stage_id]

    def num_pipe_buffers(self) -> int:
        return self.virtual_stages * self.micro_batches

    def slot(self, m: int, c: int) -> int:
        return (c // self.stages) * self.micro_batches + m

    def steps(self):
        C = self.stages * self.virtual_stages
        for kind, m, c in self.order:
            kw = {"buffer_id": self.slot(m, c), "chunk": c, "micro_batch": m}
            cmds = []
            if kind == "F":
                if c == 0 or c == C - 1:
                    cmds.append(ds_schedule.LoadMicroBatch(buffer_id=kw["buffer_id"]))
                if c > 0:
                    cmds.append(ds_schedule.RecvActivation(**kw))
                cmds.append(ds_schedule.ForwardPass(**kw))
                if c < C - 1:
                    cmds.append(ds_schedule.SendActivation(**kw))
            else:
                if c < C - 1:
                    cmds.append(ds_schedule.RecvGrad(**kw))
                cmds.append(ds_schedule.BackwardPass(**kw))
                if c > 0:
                    cmds.append(ds_schedule.SendGrad(**kw))
            yield cmds
        tail: list = [WaitSends()]
        if self.train:
            tail += [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]
        yield tail
