"""atheris target: a follower's push and pull handling (FollowerShard.open_push, handle,
open_pull; issue 13), behind the decoders.

Frames: ``[header JSON, tensors JSON, chunk bytes...]``. Flags: bit 0 — add the leader's
valid ticket for cluster "a", push 0000000000000001, round 1 (0 with bit 1), so the fuzzer
reaches the shard's own checks; bit 1 — sent ahead of its round; bit 2 — single message
(the tensors from the chunk bytes) instead of a stream; bit 3 — a pull instead of a push.
Every input must be served by the rules or refused with Refused or ValueError, and nothing
beyond one FP32 buffer for the one admitted (round, cluster) may be allocated.
"""

from __future__ import annotations

import json
import os
import sys

import atheris
import torch

with atheris.instrument_imports(include=["dips"]):
    from dips.algo.refusal import Refused
    from dips.roles.follower import FollowerShard
    from dips.wire import admission
    from dips.wire.frames import FrameError, Message, check_spec
    from dips.wire.stream import ChunkPlan, TensorSpec

from fuzz_common import SECRET, join, split, write_seeds

ADMIT = admission.admission_key(SECRET)
SHAPES = {"a.w": (40, 30), "a.b": (30,), "b.w": (30, 20)}
LAYERS = {"a": ["a.w", "a.b"], "b": ["b.w"]}
THETA = {n: torch.randn(s) for n, s in SHAPES.items()}
REFUSALS = (Refused, ValueError)


def _json(raw: bytes):
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _shard() -> FollowerShard:
    s = FollowerShard(0, LAYERS, THETA, wire_dtype="bf16", require_tickets=True)
    s.set_admission_key(ADMIT)
    return s


def one(data: bytes) -> None:
    flags, frames = split(data)
    frames += [b""] * (2 - len(frames))
    header = _json(frames[0])
    header = header if isinstance(header, dict) else {"op": header}
    s = _shard()
    if flags & 8:
        try:
            src = s.open_pull(header)
            for i in range(len(src.specs)):
                src.tensor(i)
            src.finish()
        except REFUSALS:
            pass
        return
    if flags & 1:
        rnd = 0 if flags & 2 else 1
        body, tag = admission.sign(ADMIT, admission.Ticket(rnd, "a", "0000000000000001", 100, 0))
        header = {**header, "ticket": body, "ticket_mac": tag.hex()}
    entries = _json(frames[1])
    specs = []
    for e in entries if isinstance(entries, list) else []:
        try:
            specs.append(TensorSpec(*check_spec(e)))
        except FrameError:
            pass
    chunks = frames[2:]
    try:
        if flags & 4:
            tensors = {}
            for sp, raw in zip(specs, chunks):
                if len(raw) == sp.nbytes and sp.nbytes:
                    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                    t = t.view(torch.bfloat16 if sp.dtype == "bf16" else torch.float32)
                    tensors[sp.name] = t.reshape(sp.shape)
            s.handle(Message(header, tensors))
        else:
            sink = s.open_push(header, specs)
            plan = ChunkPlan(specs, 1024)
            try:
                for seq in range(plan.count):
                    i, off, n = plan[seq]
                    raw = chunks[seq] if seq < len(chunks) else b""
                    sink.write(i, off, memoryview((raw + bytes(n))[:n]))
                sink.commit()
            except REFUSALS as exc:
                sink.abort(str(exc))
    except REFUSALS:
        pass
    assert set(s._staged) <= {(1, "a")} and set(s._early) <= {"0000000000000001"}
    pools = getattr(s, "_pools", None)
    assert pools is None or pools[0].allocated <= 1
    for _, valid, sq, _ in s.score(1, ["a"], ["0000000000000001"]):
        assert sq >= 0.0 and sq != float("inf")


def seeds() -> list[bytes]:
    out = []
    for layer in LAYERS:
        h = json.dumps({"op": "push", "cluster": "a", "round": 1, "layer": layer,
                        "push_id": "0000000000000001", "tokens": 100}).encode()
        specs = [{"name": n, "dtype": "bf16", "shape": list(SHAPES[n])} for n in LAYERS[layer]]
        raw = [THETA[n].to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
               for n in LAYERS[layer]]
        out.append(join(1, [h, json.dumps(specs).encode(), *[r[k:k + 1024] for r in raw
                                                             for k in range(0, len(r), 1024)]]))
        out.append(join(1 | 4, [h, json.dumps(specs).encode(), *raw]))
    out.append(join(8, [json.dumps({"op": "pull", "version": 0, "layers": ["a"]}).encode()]))
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--seeds"]:  # write the seeds into an empty corpus (fuzz/run.py)
        write_seeds(sys.argv[2], seeds())
        sys.exit(0)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()
