"""GradPartitionBuffer: copy_ first, add_ after, fp32 accumulation, windows."""

from __future__ import annotations

import pytest
import torch

from z3kit.grad_partition import GradPartitionBuffer


def test_views_tile_one_flat_buffer() -> None:
    buf = GradPartitionBuffer([3, 1, 4])
    assert len(buf) == 3 and buf.dtype == torch.float32 and buf.buffer.numel() == 8
    assert [v.numel() for v in buf.views] == [3, 1, 4]
    for v in buf.views:
        assert v.untyped_storage().data_ptr() == buf.buffer.untyped_storage().data_ptr()
    buf.accumulate(2, torch.full((4,), 2.0))
    assert torch.equal(buf.buffer[4:], torch.full((4,), 2.0)), "view 2 is the last 4 elements"
    assert buf.optimizer_grads() == [None, None, buf.views[2]]
    assert buf.optimizer_grads()[2] is buf.views[2]  # the optimizer gets the view, not a copy
    assert GradPartitionBuffer(p for p in [2, 2]).buffer.numel() == 4  # type: ignore[arg-type]  # a generator too


def test_copy_on_first_contribution_then_add() -> None:
    buf = GradPartitionBuffer([2, 3])
    buf.buffer.fill_(123.0)  # garbage from before: the first contribution must overwrite it
    buf.accumulate(0, torch.tensor([1.0, 2.0]))
    assert torch.equal(buf.views[0], torch.tensor([1.0, 2.0]))
    buf.accumulate(0, torch.tensor([[0.5], [0.25]]))  # any shape with the right numel
    assert torch.equal(buf.views[0], torch.tensor([1.5, 2.25]))
    assert buf.has_grad(0) and not buf.has_grad(1)
    assert torch.equal(buf.views[1], torch.full((3,), 123.0)), "untouched partitions are left alone"

    buf.new_window()
    assert not buf.has_grad(0) and buf.optimizer_grads() == [None, None]
    buf.accumulate(0, torch.tensor([-1.0, 4.0]))
    assert torch.equal(buf.views[0], torch.tensor([-1.0, 4.0])), "a new window starts with copy_, not add_"


def test_bf16_partitions_accumulate_in_fp32() -> None:
    buf = GradPartitionBuffer([2])
    buf.accumulate(0, torch.tensor([256.0, 1.0], dtype=torch.bfloat16))
    for _ in range(3):
        buf.accumulate(0, torch.tensor([1.0, 2.0**-10], dtype=torch.bfloat16))
    # bf16 has 8 significant bits: 256 + 1 == 256 there; fp32 keeps every step
    assert buf.views[0].dtype == torch.float32
    assert torch.equal(buf.views[0], torch.tensor([259.0, 1.0 + 3 * 2.0**-10]))
    low = GradPartitionBuffer([2], dtype=torch.bfloat16)  # an explicit bf16 buffer does round
    low.accumulate(0, torch.tensor([256.0, 1.0], dtype=torch.bfloat16))
    low.accumulate(0, torch.tensor([1.0, 0.0], dtype=torch.bfloat16))
    assert low.views[0][0].item() == 256.0


def test_squared_norm_ignores_stale_views() -> None:
    buf = GradPartitionBuffer([2, 2, 1])
    buf.accumulate(0, torch.tensor([3.0, 4.0]))
    buf.accumulate(1, torch.tensor([1.0, 2.0]))
    buf.accumulate(2, torch.tensor([2.0]))
    assert buf.squared_norm().item() == 9 + 16 + 1 + 4 + 4
    buf.new_window()
    assert buf.squared_norm().item() == 0.0, "every view is stale at the start of a window"
    buf.accumulate(1, torch.tensor([0.5, 0.5]))
    # views 0 and 2 still hold last window's values; they must not count
    assert buf.squared_norm().item() == 0.5
    assert buf.squared_norm().dtype == torch.float32


def test_squared_norm_is_fp32_or_wider() -> None:
    bf = GradPartitionBuffer([1], dtype=torch.bfloat16)
    bf.accumulate(0, torch.tensor([3.0]))
    assert bf.squared_norm().dtype == torch.float32
    wide = GradPartitionBuffer([1], dtype=torch.float64)
    wide.accumulate(0, torch.tensor([1.0 + 2.0**-40], dtype=torch.float64))
    norm = wide.squared_norm()
    assert norm.dtype == torch.float64 and norm.item() == (1.0 + 2.0**-40) ** 2


def test_scale_multiplies_every_partition() -> None:
    buf = GradPartitionBuffer([2, 1])
    buf.accumulate(0, torch.tensor([2.0, -4.0]))
    buf.accumulate(1, torch.tensor([8.0]))
    buf.scale_(0.25)
    assert torch.equal(buf.buffer, torch.tensor([0.5, -1.0, 2.0]))


@pytest.mark.parametrize(
    ("sizes", "kwargs", "exc", "match"),
    [
        ([3, 0], {}, ValueError, "partition sizes must be >= 1, got 0"),
        ([3, -1], {}, ValueError, "partition sizes must be >= 1, got -1"),
        ([3.0], {}, TypeError, "partition sizes must be ints, got float"),
        ([True], {}, TypeError, "partition sizes must be ints, got bool"),
        ([3], {"dtype": torch.int64}, TypeError, "accumulation dtype must be floating point"),
        ([3], {"dtype": "float32"}, TypeError, "accumulation dtype must be floating point"),
    ],
)
def test_constructor_rejects_bad_config(sizes: list[object], kwargs: dict[str, object], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        GradPartitionBuffer(sizes, **kwargs)  # type: ignore[arg-type]


def test_accumulate_rejects_bad_partitions() -> None:
    buf = GradPartitionBuffer([2, 3])
    with pytest.raises(ValueError, match=r"partition index 2 out of range \[0, 2\)"):
        buf.accumulate(2, torch.ones(2))
    with pytest.raises(ValueError, match=r"partition index -1 out of range"):
        buf.accumulate(-1, torch.ones(3))
    with pytest.raises(TypeError, match="partition index must be an int"):
        buf.accumulate(True, torch.ones(2))
    with pytest.raises(ValueError, match="partition 1 has 3 elements, got 2"):
        buf.accumulate(1, torch.ones(2))
    with pytest.raises(ValueError, match="partition is on meta but the buffer is on cpu"):
        buf.accumulate(0, torch.ones(2, device="meta"))
    with pytest.raises(TypeError, match="partition 0 must be floating point, got torch.int64"):
        buf.accumulate(0, torch.ones(2, dtype=torch.int64))
    with pytest.raises(TypeError, match="partition must be a torch.Tensor, got list"):
        buf.accumulate(0, [1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"partition index -1 out of range"):
        buf.has_grad(-1)
    assert buf.optimizer_grads() == [None, None], "refused contributions change nothing"
