"""Gradient buckets (`bucket_bytes`): several grouped all-reduces, last layers first, the same sums."""

import json

import pytest
from conftest import assert_ok, run_workers

from tfdp.reducers.allreduce import buckets, check_bucket_bytes


def test_buckets_hold_whole_tensors_last_first():
    assert buckets([400, 400, 4000, 40], 1000) == [[3], [2], [1, 0]]
    assert buckets([400, 400, 4000, 40], None) == [[3, 2, 1, 0]]
    assert buckets([10] * 5, 25) == [[4, 3], [2, 1], [0]]
    assert sorted(i for b in buckets([7, 1, 9, 3, 5], 8) for i in b) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "1MB"])
def test_bad_bucket_bytes_names_the_problem(bad):
    with pytest.raises(ValueError, match="bucket_bytes"):
        check_bucket_bytes(bad)


@pytest.mark.multiprocess
def test_buckets_give_bit_identical_weights_with_more_collectives(tmp_path):
    results = {}
    cases = (("one-group", ["--balance", "1,1"]), ("buckets", ["--balance", "1,1", "--bucket-bytes", "512"]))
    for name, extra in cases:
        out = tmp_path / name
        out.mkdir()
        assert_ok(run_workers("balance.py", 2, ["--out", out, "--model", "mlp", *extra], timeout=240))
        results[name] = json.loads((out / "rank0.json").read_text())
    assert results["buckets"]["weights"] == results["one-group"]["weights"]  # bit for bit
    # 4 gradient tensors + the row count: 3 buckets of <= 512 bytes' worth instead of 1 group, 23 steps.
    assert results["buckets"]["collectives"] - results["one-group"]["collectives"] >= 2 * 23
