"""Algorithm tables: where they are found, how limits scale, what each call runs, what tune derives."""

import json

import pytest
import torch

from tpfuse import select
from tpfuse.bench.tune import derive_limits
from tpfuse.info import algorithm_ranges

MiB = 1 << 20


@pytest.fixture
def clean_tables(monkeypatch, tmp_path):
    monkeypatch.delenv("TPFUSE_TUNE_TABLE", raising=False)
    monkeypatch.setenv("TPFUSE_TABLE_DIR", str(tmp_path / "user"))
    select.reload_tables()
    yield tmp_path
    select.reload_tables()


def _write(path, world, limits, device="cpu"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(select.AlgorithmTable(device, world, limits).to_json()))


def test_defaults_without_a_table(clean_tables):
    table = select.algorithm_table(2, "cpu")
    assert table.source == "defaults"
    assert table.token_limits(4096) == (
        select.DEFAULT_ONESHOT_MAX_BYTES[2] // 8192,
        select.DEFAULT_FUSED_MAX_BYTES // 8192,
    )
    # the one-shot's share shrinks with the world size
    assert select.algorithm_table(8, "cpu").token_limits(4096)[0] < table.token_limits(4096)[0]


def test_user_table_wins_over_shipped_and_override_over_user(clean_tables):
    _write(clean_tables / "user" / "cpu-w2.json", 2, {4096: (10, 100)})
    assert select.algorithm_table(2, "cpu").token_limits(4096) == (10, 100)
    override = clean_tables / "mine.json"
    _write(override, 2, {4096: (3, 30)})
    import os

    os.environ["TPFUSE_TUNE_TABLE"] = str(override)
    try:
        assert select.algorithm_table(2, "cpu").token_limits(4096) == (3, 30)
        with pytest.raises(ValueError, match="table for 2 ranks, not 4"):
            select.algorithm_table(4, "cpu")
    finally:
        del os.environ["TPFUSE_TUNE_TABLE"]


def test_unlisted_hidden_takes_nearest_scaled_by_bytes(clean_tables):
    _write(clean_tables / "user" / "cpu-w2.json", 2, {4096: (64, 1024), 8192: (40, 400)})
    table = select.algorithm_table(2, "cpu")
    assert table.token_limits(2048) == (128, 2048)
    assert table.token_limits(7168) == (40 * 8192 // 7168, 400 * 8192 // 7168)


def test_bad_table_is_refused(clean_tables):
    _write(clean_tables / "user" / "cpu-w2.json", 2, {4096: (100, 10)})
    with pytest.raises(ValueError, match="oneshot_max_tokens <= fused_max_tokens"):
        select.algorithm_table(2, "cpu")


def test_choice_follows_table_and_workspace(clean_tables):
    _write(clean_tables / "user" / "cpu-w4.json", 4, {4096: (2, 100)})
    ws = 64 * 4096 * 2  # 64 rows fit
    choose = lambda n: select.choose_algorithm(n, 4096, torch.bfloat16, 4, ws, "cpu")  # noqa: E731
    assert [choose(n) for n in (1, 2, 3, 4, 64, 65)] == [
        "oneshot",
        "oneshot",
        "oneshot",
        "twoshot",
        "twoshot",
        "reference",
    ]
    assert select.max_token_num(4096, torch.bfloat16, 4, ws, "cpu") == 64
    assert select.max_token_num(4096, torch.bfloat16, 4, 1 << 30, "cpu") == 100
    assert select.max_token_num(4096, torch.float32, 4, ws, "cpu") == 0
    assert select.max_token_num(4100, torch.bfloat16, 4, ws, "cpu") == 0
    assert algorithm_ranges(4096, torch.bfloat16, 4, ws, "cpu") == [
        (1, 3, "oneshot"),
        (4, 64, "twoshot"),
        (65, None, "reference"),
    ]


def test_tune_derives_prefix_limits():
    times = {
        1: {"tpfuse:oneshot": 4.0, "nccl+norm": 12.0},
        64: {"tpfuse:oneshot": 8.0, "tpfuse:twoshot": 12.0, "nccl+norm": 20.0},
        512: {"tpfuse:oneshot": 40.0, "tpfuse:twoshot": 36.0, "nccl+norm": 60.0},
        1024: {"tpfuse:oneshot": 90.0, "tpfuse:twoshot": 70.0, "nccl+norm": 71.0},
        4096: {"tpfuse:oneshot": 400.0, "tpfuse:twoshot": 360.0, "nccl+norm": 350.0},
        8192: {"tpfuse:oneshot": 700.0, "tpfuse:twoshot": 600.0, "nccl+norm": 650.0},  # after a loss: ignored
    }
    oneshot_max, fused_max, reasons = derive_limits(times, 2)
    assert (oneshot_max, fused_max) == (64, 1024)
    assert any("NCCL + norm wins from 4096" in r for r in reasons)
    assert any("two-shot wins from 512" in r for r in reasons)


def test_rocm_defaults_are_smaller_than_nvidias_and_said_so(monkeypatch):
    """No AMD hardware has measured a table: a ROCm GPU takes smaller limits than NVIDIA's defaults."""
    for world in (2, 3, 4, 8, 16):
        for hidden in (4096, 8192):
            n = select.AlgorithmTable("x", world).token_limits(hidden)
            r = select.AlgorithmTable("x", world, rocm=True).token_limits(hidden)
            assert 0 < r[0] < n[0] and 0 < r[1] < n[1] and r[0] <= r[1], (world, hidden, n, r)
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    monkeypatch.setattr(select, "device_slug", lambda device: "amd-instinct-mi300x")
    select.reload_tables()
    try:
        table = select.algorithm_table(2, torch.device("cuda", 0))
        assert table.rocm and "not measured on AMD hardware" in table.source
        assert not select.algorithm_table(2, "cpu").rocm
    finally:
        select.reload_tables()
