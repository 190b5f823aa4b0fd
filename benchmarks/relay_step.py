"""What one engine step's frames cost to send to another process (CPU, no GPU needed).

A split placement (``--tts_engine.process engine``) sends each step's frames to the vocoder
as ONE :class:`~omnistage.core.messages.StreamBatch` of ``B`` :class:`CodeFrames`, each a
``[1, 16]`` view of the step's ``[B, 16]`` host tensor. This prints, per batch size, the
best of ``--repeat`` runs of :func:`omnistage.pipeline.relay.dumps` (on the engine's
thread) and :func:`~omnistage.pipeline.relay.loads` (the receiving process), and the bytes
sent::

    python benchmarks/relay_step.py
"""

from __future__ import annotations

import argparse
import time

import torch

from omnistage.core.messages import StreamBatch, StreamChunk
from omnistage.pipeline import relay
from omnistage.scheduling.ar import CodeFrames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    print(f"{'streams':>8} {'dumps ms':>9} {'loads ms':>9} {'bytes':>9}")
    for b in args.batch:
        step = torch.randint(0, 2048, (b, 16))
        batch = StreamBatch("tts_engine", tuple(StreamChunk(f"r{i}", "tts_engine", CodeFrames(step[i : i + 1])) for i in range(b)))
        dumps = loads = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            data = relay.dumps(batch, "relay_step_")
            t1 = time.perf_counter()
            relay.loads(data)
            dumps, loads = min(dumps, t1 - t0), min(loads, time.perf_counter() - t1)
        print(f"{b:>8} {dumps * 1e3:>9.2f} {loads * 1e3:>9.2f} {len(data):>9}")


if __name__ == "__main__":
    main()
