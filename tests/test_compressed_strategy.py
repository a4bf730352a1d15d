"""CompressedStrategy on 2 real workers: bytes, identical weights, logs, save/load.

One horovodrun job fits an MLP (784-256-256-10, 269k parameters) for 8 steps with each
compressor; the bytes each rank handed to collectives are checked against the bytes
computed here, independently, from the variable shapes.
"""

import math

import numpy as np
import pytest
from conftest import assert_ok, load_without_tfdp, run_workers

pytestmark = pytest.mark.multiprocess
STEPS = 8
MIN_COMPRESS_BYTES = 1024  # CompressedStrategy's default.
WITHOUT_ERROR_FEEDBACK = {"qsgd", "randomk"}  # as workers/compressed.py configures them


def numel(shape):
    return math.prod(shape)


def expected_bytes(name, shape):
    """Bytes per step one worker hands to collectives for a gradient of `shape`."""
    n = numel(shape)
    if n * 4 < MIN_COMPRESS_BYTES or name == "none":
        return 4 * n
    if name in ("fp16", "bf16"):
        return 2 * n
    if name == "topk":
        return 8 * math.ceil(0.01 * n)  # float32 value + int32 index
    if name == "randomk":
        return 4 * math.ceil(0.05 * n)  # values only: indices come from the shared seed
    if name == "qsgd":
        return 4 + n  # norm + int8 levels
    if name == "efsign":
        return math.ceil(n / 8) + 4 * math.ceil(n / 256)  # packed signs + one scale per 256
    if name.startswith("powersgd"):
        if len(shape) < 2:
            return 4 * n
        rows, cols = numel(shape[:-1]), shape[-1]
        # Alternating: P (rows x 4) on even steps, Q (cols x 4) on odd ones; 6 steps after warm-up.
        factors = (rows + cols) * 4 // (2 if name == "powersgd-alternate" else 1)
        return 4 * factors if (rows + cols) * 4 < rows * cols else 4 * n
    raise AssertionError(name)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compressed")
    run = run_workers("compressed.py", 2, ["--out", out], timeout=420)
    assert_ok(run)
    return out, run.results(out, 2)


def row_bytes(name):
    """The row count (one float32 per step) rides along unless error feedback is on."""
    return 4 if name in WITHOUT_ERROR_FEEDBACK else 0


def delta(result, field):
    return result["after"][field] - result["before"][field]


ALL = ["none", "fp16", "bf16", "topk", "randomk", "qsgd", "efsign", "powersgd", "powersgd-alternate"]


@pytest.mark.parametrize("name", ALL)
def test_gradient_bytes_are_what_the_shapes_say(results, name):
    _, ranks = results
    for rank in ranks:
        case = rank[name]
        dense = sum(4 * numel(s) for s in case["shapes"])
        compressed = sum(expected_bytes(name, s) for s in case["shapes"])
        warmup = 2 if name.startswith("powersgd") else 0  # powersgd's first 2 steps are dense
        assert delta(case, "steps") == STEPS
        assert delta(case, "dense_bytes") == STEPS * dense
        # Plus each step's row count (one float32) where it is sent with the gradients.
        sent = warmup * dense + (STEPS - warmup) * compressed + STEPS * row_bytes(name)
        assert delta(case, "gradient_bytes") == sent
        # The logger reports the epoch's mean per step.
        assert case["history"]["gradient_bytes_per_step"] == [delta(case, "gradient_bytes") / STEPS]
        assert case["history"]["dense_bytes_per_step"] == [dense]


def test_alternating_powersgd_sends_one_collective_a_step_where_powersgd_sends_two(results):
    _, ranks = results
    for rank in ranks:
        two_rounds, alternating = (delta(rank[name], "collectives") for name in ("powersgd", "powersgd-alternate"))
        assert two_rounds - alternating == STEPS - 2  # one fewer on every step after the 2 dense ones


# Nominal ratios: 2x for 16-bit, 50x for top-1% with int32 indices, 28.4x for 1-bit signs
# with one float32 scale per 256 entries. Issue 3 asks for >= 0.9 x nominal, and at
# least 45x for top-k 1% and 25x for efsign.
NOMINAL = {"fp16": 2.0, "bf16": 2.0, "topk": 50.0, "efsign": 1024 / 36}
ABSOLUTE = {"topk": 45.0, "efsign": 25.0}


@pytest.mark.parametrize("name", sorted(NOMINAL))
def test_compression_ratio_meets_its_nominal_bound(results, name):
    _, ranks = results
    ratio = ranks[0][name]["history"]["compression_ratio"][0]
    assert ratio >= max(0.9 * NOMINAL[name], ABSOLUTE.get(name, 0)), ratio
    # Negative control of the check itself: dense float32 is 1x, below every bound.
    assert ranks[0]["none"]["history"]["compression_ratio"][0] == 1.0


@pytest.mark.parametrize("name", ALL)
def test_ranks_hold_identical_weights_after_every_step(results, name):
    _, (rank0, rank1) = results
    assert len(rank0[name]["checksums"]) == STEPS
    assert rank0[name]["checksums"] == rank1[name]["checksums"]
    assert rank0[name]["weights"] == rank1[name]["weights"]


ADAM_CASES = {"topk-adam": "topk", "qsgd-adam": "qsgd", "efsign-adam": "efsign"}  # as in workers/compressed.py


@pytest.mark.parametrize("name", sorted(ADAM_CASES))
def test_under_adam_each_worker_steps_locally_and_the_steps_travel_compressed(results, name):
    """Update compression: the same payload bytes as the gradient would take, no row count,
    identical weights after every step, and each rank's own Adam moments."""
    _, (rank0, rank1) = results
    codec = ADAM_CASES[name]
    assert rank0[name]["compresses_updates"] and not rank0[codec]["compresses_updates"]
    compressed = sum(expected_bytes(codec, s) for s in rank0[name]["shapes"])
    assert delta(rank0[name], "gradient_bytes") == STEPS * compressed
    assert rank0[name]["checksums"] == rank1[name]["checksums"]
    assert rank0[name]["weights"] == rank1[name]["weights"]
    # The moments are each worker's own (its own gradients); a synchronous run's would match.
    moments0, moments1 = rank0[name]["optimizer_state"], rank1[name]["optimizer_state"]
    assert max(np.max(np.abs(np.subtract(a, b))) for a, b in zip(moments0, moments1)) > 1e-6
    # Control: under momentum SGD (gradient compression) the optimizer states are the same.
    assert rank0[codec]["optimizer_state"] == rank1[codec]["optimizer_state"]


def test_compressed_training_moves_away_from_sync_only_by_compression(results):
    # Same seed and data: fp16 stays within fp16 rounding of float32 ("none"); top-k
    # with 1% of the entries does not, so the comparison can tell them apart.
    _, (rank0, _) = results

    def max_rel(a, b):
        return max(np.max(np.abs(np.subtract(x, y))) / (np.max(np.abs(y)) + 1e-12)
                   for x, y in zip(rank0[a]["weights"], rank0[b]["weights"]))

    assert max_rel("fp16", "none") < 1e-2
    assert max_rel("topk", "none") > 1e-2


def test_custom_loop_distributed_optimizer_with_fp16(results):
    _, (rank0, rank1) = results
    stats = rank0["custom-loop"]["stats"]
    assert stats["steps"] == STEPS
    shapes = rank0["fp16"]["shapes"]  # the same MLP
    assert stats["dense_bytes"] == STEPS * sum(4 * numel(s) for s in shapes)
    assert stats["gradient_bytes"] == STEPS * sum(expected_bytes("fp16", s) for s in shapes)
    assert rank0["custom-loop"]["weights"] == rank1["custom-loop"]["weights"]


def test_tensorboard_gets_the_ratio_on_rank0_only(results):
    out, _ = results
    import tensorflow as tf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_dirs = sorted(p.name for p in out.iterdir() if p.name.startswith("tb-"))
    assert len(event_dirs) == len(ALL) + len(ADAM_CASES)  # one per fitted case, written by rank 0
    accumulator = EventAccumulator(str(out / "tb-topk"), size_guidance={"tensors": 0}).Reload()
    [event] = accumulator.Tensors("communication/compression_ratio")
    assert float(tf.make_ndarray(event.tensor_proto)) >= 45
    assert len(list((out / "tb-topk").iterdir())) == 1  # one writer: rank 0


def test_saved_model_loads_without_tfdp(results):
    out, _ = results
    loaded = load_without_tfdp(out / "topk.keras")
    assert (loaded["optimizer"], loaded["params"]) == ("SGD", 269322)


@pytest.mark.parametrize("name, preset", [("fp16", "fp16"), ("bf16", "bf16"), ("topk", "topk-1pct"),
                                          ("qsgd", "qsgd"), ("efsign", "efsign")])
def test_advisor_predicts_the_measured_payload(results, name, preset):
    # tfdp advise computes payloads from the codecs; they must match what was sent.
    from tfdp import presets
    from tfdp.tools import advisor

    _, (rank0, _) = results
    case = rank0[name]
    spec = presets.load_preset(preset)
    payloads, _ = advisor.exchange(spec["options"], spec["strategy"], [tuple(s) for s in case["shapes"]])
    assert sum(b for b, _ in payloads) * STEPS == delta(case, "gradient_bytes")
