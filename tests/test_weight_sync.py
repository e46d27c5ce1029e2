"""sync.send_weights / receive_weights: the broadcast transport of --weight_sync broadcast,
between two real processes over gloo (the engine side runs the same code inside vLLM's worker)."""

import io
import multiprocessing as mp

import torch

import parallel
import sync


def _receiver(port: int, out, updates: int):
    group = sync.weight_sync_group("127.0.0.1", port, 1, 2, torch.device("cpu"))
    for _ in range(updates):
        # kept as received (no copy) until the update ends, as vLLM's layerwise reload may keep them
        got = [(name, t.dtype, t) for name, t in sync.receive_weights(group, torch.device("cpu"))]
        buf = io.BytesIO()  # bytes, not tensors: a queued tensor's shared memory dies with this process
        torch.save([(name, dtype, t.clone()) for name, dtype, t in got], buf)   # copied once the update is done
        out.put(buf.getvalue())


def test_bucketed_broadcast_is_bit_exact_in_every_dtype():
    """Two updates with other values (on CPU both sides reuse buffers across updates, never
    within one: the first update's tensors, kept uncopied, must still hold their values at its end)."""
    weights = {"a.weight": torch.randn(3, 5), "b.bf16": torch.randn(7, dtype=torch.bfloat16),
               "c.big": torch.randn(300, 100), "d.half": torch.randn(2, 2, 2, dtype=torch.float16),
               "e.ids": torch.arange(4), "f.scalar": torch.tensor(2.5)}
    assert len(sync.bucket_plan(weights, 4096)) == 3  # c.big is over the bucket: its own
    port, ctx = parallel.free_port(), mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, out, 2))
    proc.start()
    group = sync.weight_sync_group("127.0.0.1", port, 0, 2, torch.device("cpu"))
    for update in range(2):
        if update:
            weights = {k: (v * 3 + 1).to(v.dtype) for k, v in weights.items()}
        sent = sync.send_weights(group, weights, 4096, "cpu")   # the trainer passes a string
        got = torch.load(io.BytesIO(out.get(timeout=60)))
        assert sent == sum(t.numel() * t.element_size() for t in weights.values())
        assert [name for name, _, _ in got] == list(weights)
        for name, dtype, t in got:
            assert dtype == weights[name].dtype and torch.equal(t, weights[name]), (update, name)
    proc.join(timeout=60)
