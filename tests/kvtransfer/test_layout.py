"""KVLayout: the pool contract two workers must share (docs/architecture.md, "KV pool")."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.kvtransfer.nixl import KVLayout, KVTransferAgent, LayoutMismatchError

LLAMA_8B = KVLayout("llama-3-8b", "bfloat16", num_layers=32, num_blocks=100, block_size=16,
                    num_kv_heads=8, head_dim=128)


def test_block_bytes_counts_k_and_v_of_one_layer():
    # 2 (K,V) x 16 tokens x 8 heads x 128 dims x 2 bytes
    assert LLAMA_8B.block_bytes == 65536
    # Llama-3-8B in bf16: 128 KiB of KV per token across layers
    assert LLAMA_8B.block_bytes * LLAMA_8B.num_layers // LLAMA_8B.block_size == 128 * 1024


def test_from_tensor_reads_shape_and_dtype():
    kv = torch.empty(3, 10, 2, 4, 2, 8, dtype=torch.float16)
    layout = KVLayout.from_tensor(kv, "tiny")
    assert layout == KVLayout("tiny", "float16", 3, 10, 4, 2, 8)
    assert layout.pool_bytes == kv.numel() * kv.element_size()


def test_from_tensor_rejects_a_tensor_without_the_kv_axis():
    with pytest.raises(ValueError, match="num_layers, num_blocks, 2"):
        KVLayout.from_tensor(torch.empty(3, 10, 3, 4, 2, 8), "tiny")


def test_block_offset_matches_the_tensor_address_of_each_block():
    kv = torch.zeros(3, 5, 2, 4, 2, 8, dtype=torch.bfloat16)
    layout = KVLayout.from_tensor(kv, "tiny")
    for layer in range(3):
        for block in range(5):
            address = kv[layer, block].data_ptr() - kv.data_ptr()
            assert layout.block_offset(layer, block) == address


def test_dict_round_trip_is_json_and_checks_block_bytes():
    record = json.loads(json.dumps(LLAMA_8B.to_dict()))
    assert record["block_bytes"] == 65536
    assert KVLayout.from_dict(record) == LLAMA_8B
    with pytest.raises(ValueError, match="block_bytes"):
        KVLayout.from_dict({**record, "block_bytes": 1})
    with pytest.raises(ValueError, match="unknown keys"):
        KVLayout.from_dict({**record, "pipeline_size": 2})
    # A TP rank's pool: its share of the heads, the model's heads, its rank; records without
    # the TP fields (TP=1 workers) read as TP=1 NHD.
    rank = KVLayout("llama-3-8b", "bfloat16", 32, 100, 16, 4, 128, kv_layout="HND", total_kv_heads=8, tp_size=2,
                    tp_rank=1)
    assert KVLayout.from_dict(json.loads(json.dumps(rank.to_dict()))) == rank
    assert rank.shape == (32, 100, 2, 4, 16, 128)
    legacy = {k: v for k, v in record.items() if k not in ("kv_layout", "total_kv_heads", "tp_size", "tp_rank")}
    assert KVLayout.from_dict(legacy) == LLAMA_8B
    assert (LLAMA_8B.kv_layout, LLAMA_8B.total_kv_heads, LLAMA_8B.tp_size) == ("NHD", LLAMA_8B.num_kv_heads, 1)
    with pytest.raises(ValueError, match="tp_rank"):
        KVLayout("m", "float16", 1, 1, 16, 4, 64, tp_size=2, tp_rank=2)


@pytest.mark.parametrize(
    "field, value",
    [("model_id", "mistral-7b"), ("dtype", "float16"), ("num_layers", 40),
     ("block_size", 32), ("num_kv_heads", 4), ("head_dim", 64)],
)
def test_check_compatible_names_the_differing_field(field, value):
    other = KVLayout(**{**_fields(LLAMA_8B), field: value})
    with pytest.raises(LayoutMismatchError) as info:
        LLAMA_8B.check_compatible(other)
    assert (info.value.field, info.value.mine, info.value.theirs) == (field, getattr(LLAMA_8B, field), value)
    assert field in str(info.value)


def test_pools_of_different_sizes_are_compatible():
    LLAMA_8B.check_compatible(KVLayout(**{**_fields(LLAMA_8B), "num_blocks": 7}))


@pytest.mark.parametrize(
    "field, value", [("dtype", "float64"), ("num_blocks", 0), ("head_dim", True), ("model_id", "")]
)
def test_invalid_layouts_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        KVLayout(**{**_fields(LLAMA_8B), field: value})


def test_agent_refuses_a_pool_that_does_not_match_its_layout():
    kv = torch.empty(3, 10, 2, 4, 2, 8, dtype=torch.float16)
    layout = KVLayout.from_tensor(kv, "tiny")
    with pytest.raises(ValueError, match="shape"):
        KVTransferAgent("a", kv[:, :5], layout)
    with pytest.raises(ValueError, match="dtype"):
        KVTransferAgent("a", kv.to(torch.bfloat16), layout)
    with pytest.raises(ValueError, match="contiguous"):
        KVTransferAgent("a", kv.transpose(3, 4).contiguous().transpose(3, 4), layout)


def _fields(layout: KVLayout) -> dict:
    record = layout.to_dict()
    record.pop("block_bytes")
    return record
