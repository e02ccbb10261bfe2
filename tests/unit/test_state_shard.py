"""PD hand-off / migration payloads: one contiguous byte buffer per rank plus a typed header
(`StateShard`), serialised without pickling the state (Ray's object store, like pickle protocol
5, takes a numpy buffer out of band and hands the reader a view of it), and verified on import by
the hash the exporter computed."""
from __future__ import annotations

import pickle

import numpy as np
import torch

from engine_helpers import HYBRID, HYBRID_COMPONENTS, greedy, make_engine, make_prompts, tiny_model
from hyrax.actors.engine.manifest import PART_ALIGN, StateShard
from hyrax.actors.engine.state_hash import state_hash


def _offer(dtype=torch.float32):
    model = tiny_model(HYBRID, dtype)
    src, dst = make_engine(model), make_engine(model)
    [rid] = [src.add_request(p, greedy(max_tokens=20)) for p in make_prompts(1, seed=3, lo=30, hi=30)]
    for _ in range(100):
        if len(src.requests[rid].output_ids) >= 2:
            break
        src.step()
    src.step_outputs_flush()
    return src, dst, rid, src.export_running(rid)


def test_an_exported_shard_is_one_byte_buffer_that_pickles_out_of_band():
    _, _, _, handoff = _offer()
    [shard] = handoff["payload"]
    assert isinstance(shard, StateShard) and isinstance(shard.buffer, np.ndarray)
    assert shard.buffer.dtype == np.uint8 and shard.buffer.ndim == 1 and shard.buffer.flags.c_contiguous
    assert set(shard.parts) == set(HYBRID_COMPONENTS)
    assert all(p.offset % PART_ALIGN == 0 for p in shard.parts.values())
    out_of_band = []
    inband = pickle.dumps(handoff["payload"], protocol=5, buffer_callback=out_of_band.append)
    assert [len(b.raw()) for b in out_of_band] == [shard.buffer.nbytes]
    assert len(inband) < 4096 < shard.buffer.nbytes  # only the header travels in the pickle
    # what the exporter reported is the hash of each component's bytes in the buffer
    m = handoff["manifest"]
    for name in HYBRID_COMPONENTS:
        assert m.components[name].checksums[0] == state_hash(shard.tensor(name))


def test_a_read_only_received_buffer_imports_verified_and_a_flipped_bit_does_not():
    src, dst, rid, handoff = _offer(torch.bfloat16)
    [shard] = handoff["payload"]
    got = [pickle.loads(pickle.dumps(s, protocol=5, buffer_callback=(b := []).append), buffers=b) for s in [shard]]
    got[0].buffer.flags.writeable = False  # as Ray hands it over: a view of shared memory
    assert dst.import_request({**handoff, "payload": got}).value == "verified"
    src.release_handoff(rid)

    src2, dst2, rid2, handoff2 = _offer(torch.bfloat16)
    [shard2] = handoff2["payload"]
    p = shard2.parts["mamba_conv"]
    shard2.buffer[p.offset + p.nbytes // 2] ^= 0x04  # one bit, after the exporter hashed it
    assert dst2.import_request(handoff2).value == "checksum_mismatch"
    assert dst2.stats.checksum_failures == 1
