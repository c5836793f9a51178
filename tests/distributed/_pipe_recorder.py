"""``python -m torch.distributed.run ... _pipe_recorder.py OUT_DIR [overrides]``: train like ``msar-train`` and
record, per rank, the activation tensors its DeepSpeed pipeline engine sends and receives (shapes, dtypes) and
the stage layer ranges it uses, in ``OUT_DIR/rank{RANK}.json``. Used by tests/distributed/test_plan.py to
check ``msar-plan`` against what really crosses a stage boundary.

Recorded at ``deepspeed.runtime.pipe.p2p.send`` (the call that puts a tensor on the wire) while the engine
sends activations, excluding the shape metadata it sends first; received activations are the engine's
input buffers after ``_exec_recv_activations``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from deepspeed.runtime.pipe import engine as pipe_engine
from deepspeed.runtime.pipe import p2p

from msar_train.train.cli import main

record: dict = {"sent": [], "received": [], "parts": None, "stage": None}
_sending = [False]


def _desc(t) -> dict:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


_p2p_send = p2p.send


def _send(tensor, dest_stage, async_op=False):
    if _sending[0]:
        record["sent"][-1].append(_desc(tensor))
    return _p2p_send(tensor, dest_stage, async_op=async_op)


p2p.send = _send
_exec_send = pipe_engine.PipelineEngine._exec_send_activations
_exec_recv = pipe_engine.PipelineEngine._exec_recv_activations
_send_meta = pipe_engine.PipelineEngine._send_tensor_meta


def _exec_send_activations(self, buffer_id):
    record["parts"], record["stage"] = list(self.module.parts), self.stage_id
    record["sent"].append([])
    _sending[0] = True
    try:
        return _exec_send(self, buffer_id)
    finally:
        _sending[0] = False


def _send_tensor_meta(self, buffer, recv_stage):
    was, _sending[0] = _sending[0], False
    try:
        return _send_meta(self, buffer, recv_stage)
    finally:
        _sending[0] = was


def _exec_recv_activations(self, buffer_id):
    out = _exec_recv(self, buffer_id)
    record["parts"], record["stage"] = list(self.module.parts), self.stage_id
    got = self.pipe_buffers["inputs"][buffer_id]
    record["received"].append([_desc(t) for t in (got if isinstance(got, tuple) else (got,))])
    return out


_E = pipe_engine.PipelineEngine
_E._send_tensor_meta = _send_tensor_meta
# The schedule dispatches through a class-level instruction -> function map.
_E._INSTRUCTION_MAP = {
    **_E._INSTRUCTION_MAP,
    pipe_engine.schedule.SendActivation: _exec_send_activations,
    pipe_engine.schedule.RecvActivation: _exec_recv_activations,
}

if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    rc = main(sys.argv[2:])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))
    sys.exit(rc)
