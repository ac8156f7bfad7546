from __future__ import annotations

import anyio
import pytest
import torch

from stages.vision_encode import VisionEncodeStage
from tests.images import make_image
from vision.checkpoint import Checkpoint
from vision.encoder import VisionEncoder
from vision.preprocess import PreparedImage, preprocess_image


@pytest.fixture(scope="module")
def encoder(checkpoint: Checkpoint) -> VisionEncoder:
    return VisionEncoder(checkpoint)


def prepared(checkpoint: Checkpoint, seed: int, width: int = 64, height: int = 48) -> PreparedImage:
    return preprocess_image(checkpoint.image_processor, make_image(width, height, seed=seed))


async def test_concurrent_images_are_encoded_together(encoder: VisionEncoder, checkpoint: Checkpoint) -> None:
    stage = VisionEncodeStage(encoder, max_batch=8, wait_ms=50, queue_size=16)
    images = [prepared(checkpoint, seed, 32 + 16 * seed) for seed in range(6)]
    results: dict[int, torch.Tensor] = {}

    async def one(i: int) -> None:
        out = await stage.run([images[i]])
        assert out is not None
        results[i] = out

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(stage.run_batcher)
            async with anyio.create_task_group() as requests:
                for i in range(6):
                    requests.start_soon(one, i)
            await stage.aclose()
    assert max(stage.batch_sizes) > 1 and sum(stage.batch_sizes) == 6
    for i, image in enumerate(images):
        assert results[i].shape == (image.num_patches, encoder.hidden_size)
        assert torch.allclose(results[i], encoder.encode([image])[0], atol=1e-5)  # batching changes nothing
    assert stage.limiter.borrowed_tokens == 0
