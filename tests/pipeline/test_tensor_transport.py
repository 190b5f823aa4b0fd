"""Tensors stay where they were made: same process -> the object itself; other process ->
shared memory (CPU) or CUDA IPC (GPU), chosen from the tensor's device."""

import os

import numpy as np
import pytest
import torch

from omnistage.core.messages import StreamBatch, StreamChunk
from omnistage.pipeline import relay
from omnistage.pipeline.pipeline import Pipeline
from omnistage.scheduling.ar import CodeFrames
from omnistage.testing import toy
from omnistage.testing.leaks import assert_no_request_state

pytestmark = pytest.mark.anyio
NUMEL = 1 << 16
EXPECTED_SUM = float(torch.arange(NUMEL, dtype=torch.float32).sum())


async def outputs(device: str, processes):
    async with Pipeline(toy.tensor_config(device, processes)) as pipeline:
        result = await pipeline.submit(toy.ToyRequest("t")).result()
        await assert_no_request_state(pipeline)
    return result.outputs["inspect"]


async def test_same_process_passes_the_tensor_itself():
    device, same_memory, total = await outputs("cpu", (None, None))
    assert device == "cpu" and same_memory and total == EXPECTED_SUM


async def test_cpu_tensor_crosses_processes_through_shared_memory():
    device, same_memory, total = await outputs("cpu", ("a", "b"))
    assert device == "cpu" and not same_memory and total == EXPECTED_SUM


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_tensor_crosses_processes_by_cuda_ipc_and_stays_on_the_gpu():
    device, _, total = await outputs("cuda:0", ("a", "b"))
    assert device == "cuda:0" and total == EXPECTED_SUM


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_tensor_in_process_is_not_copied():
    device, same_memory, total = await outputs("cuda:0", (None, None))
    assert device == "cuda:0" and same_memory and total == EXPECTED_SUM


def test_a_steps_code_frames_cross_processes_as_their_own_rows():
    """The frames of one engine step are views of its ``[B, G]`` tensor; each must travel as
    its own 16 codes, not with the step's whole storage (which made a 128-stream step
    2 MB to pickle)."""
    step = torch.randint(0, 2048, (128, 16))
    batch = StreamBatch("engine", tuple(StreamChunk(f"r{i}", "engine", CodeFrames(step[i : i + 1])) for i in range(128)))
    data = relay.dumps(batch, "test_code_frames_")
    assert len(data) < 64 * 1024  # 128 x 128 bytes of codes plus framing
    got = relay.loads(data)
    for i, chunk in enumerate(got.chunks):
        assert chunk.request_id == f"r{i}" and chunk.source == "engine"
        assert chunk.data.codes.dtype == torch.int64 and torch.equal(chunk.data.codes, step[i : i + 1])


def test_a_read_only_array_crosses_by_shared_memory_without_a_writable_view(recwarn):
    """A cached reference clip is a read-only array: it is copied into its segment by numpy
    (no torch view of read-only memory, which torch warns of), and arrives equal."""
    clip = np.linspace(-1.0, 1.0, relay.SHM_MIN_BYTES, dtype=np.float32)
    clip.flags.writeable = False
    data = relay.dumps({"clip": clip}, f"/omnistage-test-{os.getpid()}-")
    assert len(data) < relay.SHM_MIN_BYTES  # the samples went to a segment
    got = relay.loads(data)["clip"]
    assert got.dtype == np.float32 and np.array_equal(got, clip)
    assert not [w for w in recwarn if "not writable" in str(w.message)]
