"""The sparse path in `fit` on 2 workers: a 100,000-row embedding sends the rows a batch
touched, and trains to the weights of one process with the same global batches; a 16-row
table whose every row each worker touches goes dense (the negative control)."""

import json

import numpy as np
import pytest
from conftest import assert_ok, run_workers

pytestmark = pytest.mark.multiprocess
STEPS = 10  # global batches in tests/workers/sparse.py


def max_relative(a, b):
    return max(float(np.max(np.abs(np.subtract(x, y))) / (np.max(np.abs(y)) + 1e-12)) for x, y in zip(a, b))


def test_an_embedding_sends_its_touched_rows_and_matches_one_process(tmp_path):
    assert_ok(run_workers("sparse.py", 2, ["--out", tmp_path], timeout=240))
    for rank in range(2):
        all_stats = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for table in ("large", "small"):
            with np.load(tmp_path / f"rank{rank}-{table}.npz") as saved:
                count = len(saved.files) // 2
                difference = max_relative([saved[f"weights_{i}"] for i in range(count)],
                                          [saved[f"reference_{i}"] for i in range(count)])
            stats = all_stats[table]
            ratio = stats["dense_bytes"] / stats["gradient_bytes"]
            print(f"\nrank {rank}, {table} table: 2 workers vs one process {difference:.2e}, gradient bytes "
                  f"{stats['gradient_bytes']} of {stats['dense_bytes']} dense ({ratio:.1f}x fewer)")
            assert difference <= 1e-6
            if table == "large":
                assert ratio >= 10
            else:  # every row touched: the dense tensor travels, plus the row count (4 bytes a step);
                # its rows with their index would have been 16 x 17 floats, not 16 x 16
                assert stats["gradient_bytes"] == stats["dense_bytes"] + 4 * STEPS
