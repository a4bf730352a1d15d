"""Fast in-process tests: no horovodrun, one worker."""

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import presets
from tfdp.keras.callbacks import LearningRateWarmup
from tfdp.strategies import output

REPO = Path(__file__).resolve().parents[1]


def test_public_api_is_pinned():
    assert sorted(tfdp.__all__) == [
        "AsyncStrategy", "AutoStrategy", "CompressedStrategy", "DistributedOptimizer", "MirroredStrategy", "callbacks", "compression",
        "init", "is_chief", "local_rank", "preset_names", "rank", "replica_device", "restore_stdout",
        "set_worker_stdout", "size", "strategy", "worker_stdout",
    ]
    for name in tfdp.__all__:
        assert hasattr(tfdp, name)


def test_single_process_strategy_is_plain_keras():
    x = np.random.default_rng(0).normal(size=(96, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def train(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(4)
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        return model.get_weights()

    strategy = tfdp.MirroredStrategy()
    ours, plain = train(strategy), train(tf.distribute.get_strategy())
    for a, b in zip(ours, plain):
        np.testing.assert_array_equal(a, b)
    stats = strategy.communication_stats()
    assert stats["steps"] == 6 and stats["payload_bytes"] == 0  # one worker: nothing sent
    assert stats["dense_bytes"] == 6 * (3 * 4 + 4 + 4 + 1) * 4


# -- presets ----------------------------------------------------------------------


def test_sync_preset_resolves_by_name_and_environment(monkeypatch):
    assert "sync" in tfdp.preset_names()
    assert isinstance(tfdp.strategy("sync"), tfdp.MirroredStrategy)
    monkeypatch.setenv("TFDP_STRATEGY", "sync")
    assert isinstance(tfdp.strategy(), tfdp.MirroredStrategy)


@pytest.mark.parametrize(
    "text, message",
    [
        ("description: x\nstrategy: mirrored\noptions: {}\nspeed: 11\n", "unknown keys ['speed']"),
        ("description: x\nstrategy: mirrored\n", "missing key 'options'"),
        ("description: x\nstrategy: mirrored\noptions: [1]\n", "'options' must be a dict"),
        ("description: x\nstrategy: warp\noptions: {}\n", "unknown strategy 'warp'"),
        ("description: [unclosed\n", "not valid YAML"),
        ("- a list\n", "must be a mapping"),
        ("!!python/object/apply:os.system ['echo pwned']\n", "not valid YAML"),
    ],
)
def test_invalid_presets_are_clear_errors(text, message):
    with pytest.raises(ValueError, match=None) as err:
        presets.parse_preset(text, source="test.yaml")
    assert message in str(err.value) and "test.yaml" in str(err.value)


def test_the_strategy_kinds_checked_without_tensorflow_are_the_classes_built():
    assert sorted(presets._strategy_classes()) == list(presets.STRATEGY_KINDS)


def test_unknown_preset_lists_the_choices(monkeypatch):
    monkeypatch.setenv("TFDP_STRATEGY", "nope")
    with pytest.raises(ValueError, match=r"Unknown strategy preset 'nope'. Available presets: \[.*'sync'"):
        tfdp.strategy()


def test_presets_resolve_after_plain_pip_install(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(REPO)],
        check=True, timeout=300, cwd=tmp_path,
    )
    code = "import tfdp, json; print(json.dumps(tfdp.preset_names())); print(tfdp.__file__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(target), "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    names, location = out.stdout.strip().splitlines()[-2:]
    assert "sync" in names and location.startswith(str(target))


def test_cli_lists_presets_and_rejects_unknown_ones(capsys):
    from tfdp.tools import cli

    assert cli.main(["presets"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == tfdp.preset_names()
    assert {"sync", "fp16", "topk-1pct", "powersgd-r4", "efsign", "async-s1", "async-s2",
            "local-sgd-h16"} <= set(listed)
    assert cli.main(["run", "-np", "2", "--strategy", "nope", "x.py"]) == 2
    assert "Unknown strategy preset 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("name", tfdp.preset_names())
def test_every_preset_builds_its_strategy(name):
    strategy = tfdp.strategy(name)
    kind = presets.load_preset(name)["strategy"]
    expected = {"mirrored": tfdp.MirroredStrategy, "compressed": tfdp.CompressedStrategy,
                "async": tfdp.AsyncStrategy, "auto": tfdp.AutoStrategy}[kind]
    assert type(strategy) is expected


# -- optimizer wrapper and callbacks ------------------------------------------------


def test_distributed_optimizer_returns_the_same_plain_optimizer():
    optimizer = keras.optimizers.Adam(1e-3)
    assert tfdp.DistributedOptimizer(optimizer) is optimizer
    assert type(optimizer) is keras.optimizers.Adam
    assert "tfdp" not in str(optimizer.get_config())
    with pytest.raises(ValueError, match="already a tfdp.DistributedOptimizer"):
        tfdp.DistributedOptimizer(optimizer)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"op": "max"}, "`op` must be one of"), ({"backward_passes_per_step": 0}, "must be an integer >= 1")],
)
def test_distributed_optimizer_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tfdp.DistributedOptimizer(keras.optimizers.SGD(), **kwargs)


def test_learning_rate_warmup_ramps_from_lr_over_size():
    warmup = LearningRateWarmup(target_lr=0.8, warmup_epochs=2, steps_per_epoch=10)
    warmup._size = 4
    assert warmup.learning_rate_at(0, 0) == pytest.approx(0.2)
    assert warmup.learning_rate_at(1, 0) == pytest.approx(0.5)
    assert warmup.learning_rate_at(2, 0) == pytest.approx(0.8)
    assert warmup.learning_rate_at(5, 3) == pytest.approx(0.8)


def test_strategy_rejects_non_bool_global_step_logs():
    with pytest.raises(ValueError, match="`global_step_logs` must be True or False. Received: global_step_logs='no'"):
        tfdp.MirroredStrategy(global_step_logs="no")


@pytest.mark.multiprocess
def test_tfdp_run_hands_the_preset_to_every_worker(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os; print('preset=' + os.environ['TFDP_STRATEGY'], os.environ['HOROVOD_RANK'])\n")
    # Typed as for horovodrun, interpreter first: the interpreter named runs the script.
    out = subprocess.run(
        [str(Path(sys.executable).parent / "tfdp"), "run", "-np", "2", "--strategy", "sync", sys.executable,
         str(script)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert sorted(line.split(":", 1)[1] for line in out.stdout.splitlines() if "preset=" in line) == [
        "preset=sync 0", "preset=sync 1"]


def test_worker_stdout_follows_the_current_rank_and_can_be_undone(monkeypatch):
    import io

    base = io.StringIO()
    monkeypatch.setattr(sys, "stdout", base)
    monkeypatch.delenv(output.VERBOSE_WORKERS_ENV, raising=False)
    output.follow_rank(1, 2)
    wrapper = sys.stdout
    print("hidden on rank 1")
    output.follow_rank(0, 2)  # e.g. after an elastic reset this process became rank 0
    print("shown on rank 0")
    output.follow_rank(1, 2)
    assert sys.stdout is wrapper and wrapper.stream is base  # wrapped once, no file opened
    tfdp.set_worker_stdout(True)
    assert tfdp.worker_stdout()
    print("allowed on rank 1")
    tfdp.set_worker_stdout(False)
    print("hidden again")
    tfdp.restore_stdout()
    assert sys.stdout is base
    print("restored")
    assert base.getvalue().split() == ["shown", "on", "rank", "0", "allowed", "on", "rank", "1", "restored"]
    with pytest.raises(ValueError, match="`enabled` must be True or False"):
        tfdp.set_worker_stdout("yes")


def test_variants_are_presets_with_explicit_overrides(monkeypatch):
    cls, options = presets.resolve_variant("topk-1pct:compressor.ratio=0.001,local_residual=false")
    assert cls is tfdp.CompressedStrategy
    assert options == {"compressor": {"name": "topk", "ratio": 0.001}, "error_feedback": True,
                       "local_residual": False}
    _, options = presets.resolve_variant("fp16:compressor.name=randomk,compressor.ratio=0.1,error_feedback=false")
    assert options["compressor"] == {"name": "randomk", "ratio": 0.1}  # `fp16` became {name: fp16} first
    assert presets.load_preset("topk-1pct")["options"]["compressor"]["ratio"] == 0.01  # the file is untouched
    monkeypatch.setenv("TFDP_STRATEGY", "async-s1:staleness=3")
    assert tfdp.strategy().staleness == 3
    with pytest.raises(ValueError, match=r"overrides are written key=value"):
        presets.resolve_variant("sync:global_step_logs")
    with pytest.raises(ValueError, match=r"Unknown strategy preset 'nope'"):
        presets.resolve_variant("nope:x=1")
    with pytest.raises(ValueError, match=r"does not take"):
        tfdp.strategy("sync:speed=11")


def test_one_gpu_per_local_rank_and_cpu_without_gpus():
    from tfdp.runtime import choose_device

    assert [choose_device(4, r, 4) for r in range(4)] == [(r, "/gpu:0") for r in range(4)]
    assert choose_device(0, 0, 2) == (None, "/cpu:0")
    assert choose_device(4, 1, 4, setting="cpu") == (None, "/cpu:0")  # TFDP_DEVICES=cpu
    with pytest.raises(ValueError, match="runs 4 workers but has 2 GPUs: local rank 3 has none"):
        choose_device(2, 3, 4)
    with pytest.raises(ValueError, match="TFDP_DEVICES=gpu, but TensorFlow sees no GPU"):
        choose_device(0, 0, 1, setting="gpu")
    with pytest.raises(ValueError, match=r"TFDP_DEVICES must be one of \('auto', 'cpu', 'gpu'\)"):
        choose_device(1, 0, 1, setting="tpu")
    assert tfdp.replica_device() == "/cpu:0"  # this machine has no GPU


def test_loopback_host_name_in_a_multi_host_job_is_named_before_gloo_fails():
    from tfdp._compat.horovod import check_host_address, loopback_host_problem

    loopback = {"vm": "127.0.1.1", "h1": "10.0.0.1"}
    lookups = {"resolve": lambda name: loopback[name], "hostname": lambda: "vm"}
    with pytest.raises(RuntimeError, match=r"rank 1: the job spans 2 hosts, but this host's name 'vm' resolves to "
                                           r"127\.0\.1\.1, a loopback address.*/etc/hosts.*HOROVOD_HOSTNAME.*"
                                           r"--network-interface"):
        check_host_address({"HOROVOD_CROSS_SIZE": "2", "HOROVOD_RANK": "1"}, **lookups)
    # One host: loopback is fine. A host name with a network address: fine.
    assert loopback_host_problem({"HOROVOD_CROSS_SIZE": "1"}, **lookups) is None
    assert loopback_host_problem({"HOROVOD_CROSS_SIZE": "2"}, resolve=lambda n: loopback[n],
                                 hostname=lambda: "h1") is None
    # The name horovodrun reached this host by counts too: h2 mapped to loopback on h2...
    mapped = {"h2": "127.0.1.1", "h1": "10.0.0.1"}
    assert "'h2' resolves to 127.0.1.1" in loopback_host_problem(
        {"HOROVOD_CROSS_SIZE": "2", "HOROVOD_HOSTNAME": "h2"}, resolve=lambda n: mapped[n], hostname=lambda: "h1")
    # ...but hosts given by address or as localhost (one machine under several names) are fine.
    for local in ("localhost", "127.0.0.1", "10.0.0.7"):
        assert loopback_host_problem({"HOROVOD_CROSS_SIZE": "3", "HOROVOD_HOSTNAME": local}, **lookups) is None


@pytest.mark.parametrize("passthrough, expected", [
    (["train.py", "--out", "x.py"], ([], ["<this python>", "train.py", "--out", "x.py"])),
    (["--gloo", "train.py"], (["--gloo"], ["<this python>", "train.py"])),
    (["python", "train.py"], ([], ["python", "train.py"])),
    (["--gloo", "/usr/bin/python3.11", "-u", "train.py"], (["--gloo"], ["/usr/bin/python3.11", "-u", "train.py"])),
    (["python", "-c", "print(1)"], (["python", "-c", "print(1)"], [])),  # no script: all to horovodrun
])
def test_tfdp_run_runs_a_script_with_the_interpreter_named_before_it_or_its_own(passthrough, expected):
    from tfdp.tools.cli import split_command

    flags, command = expected
    assert split_command(passthrough) == (flags, [sys.executable if c == "<this python>" else c for c in command])


def test_tfdp_run_refuses_a_multi_host_job_from_a_loopback_host_name(capsys, monkeypatch):
    import socket

    from tfdp.tools import cli

    monkeypatch.setattr(socket, "gethostname", lambda: "vm")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: {"vm": "127.0.1.1"}[name])
    assert cli.main(["run", "-np", "2", "-H", "vm:1,other:1", "x.py"]) == 2
    assert "this host's name 'vm' resolves to 127.0.1.1, a loopback address" in capsys.readouterr().err


def test_import_tfdp_is_lazy_and_every_subpackage_is_an_attribute():
    # `tfdp run` and the launcher start without TensorFlow (importing it costs a worker's start-up,
    # 7-9 s here), validating `--strategy` included; scripts reach subpackages as attributes.
    code = ("import sys, tfdp; assert 'tensorflow' not in sys.modules, 'eager import'; "
            "tfdp.presets.load_variant('topk-1pct:compressor.ratio=0.02'); "
            "print(tfdp.presets.preset_names()[0], tfdp.tools.__name__, 'tensorflow' in sys.modules); "
            "print(tfdp.MirroredStrategy.__name__, tfdp.compression.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = out.stdout.strip().splitlines()[-2:]
    assert first == "async-s1 tfdp.tools False" and second == "MirroredStrategy tfdp.compression"


def test_import_tfdp_turns_on_the_pooled_cpu_allocator_unless_the_user_chose():
    # TensorFlow's BFC allocator keeps freed blocks; malloc hands large ones back to the kernel
    # (tfdp/_allocator.py). Controls: the user's explicit `false`, and an op run before the import.
    probe = "import tfdp._allocator as a; print(a.pooled_cpu_allocator_in_use())"
    cases = {
        "imported first": ("import tfdp, tensorflow as tf; tf.zeros([4]); " + probe, None),
        "user chose malloc": ("import tfdp, tensorflow as tf; tf.zeros([4]); " + probe, "false"),
        "op before import": ("import tensorflow as tf; tf.zeros([4]); import tfdp; " + probe, None),
    }
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    runs = {name: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env={**env, "TF_CPU_ALLOCATOR_USE_BFC": choice} if choice else env)
            for name, (code, choice) in cases.items()}
    seen = {}
    for name, run in runs.items():
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err[-2000:]
        seen[name] = out.split()[-1]
    assert seen == {"imported first": "True", "user chose malloc": "False", "op before import": "False"}
