"""`tfdp._compat.horovodrun`: horovodrun with its build checks remembered between launches."""

from tfdp._compat import horovodrun


def counting(answer):
    calls = []

    def check(verbose=False):
        calls.append(verbose)
        return answer

    return check, calls


def test_a_positive_answer_is_remembered_for_the_same_build_only(tmp_path):
    path = tmp_path / "horovod-build.json"
    check, calls = counting(True)
    assert horovodrun.remembered("gloo_built", check, "build-1", path)() is True
    assert horovodrun.remembered("gloo_built", check, "build-1", path)() is True
    assert len(calls) == 1  # the second launch read the file
    # Negative control: another build (Horovod or TensorFlow reinstalled) checks again.
    assert horovodrun.remembered("gloo_built", check, "build-2", path)() is True
    assert len(calls) == 2
    # Each check is remembered under its own name.
    mpi, mpi_calls = counting(True)
    horovodrun.remembered("mpi_built", mpi, "build-2", path)()
    assert len(mpi_calls) == 1


def test_a_negative_answer_or_an_unknown_build_is_never_remembered(tmp_path):
    path = tmp_path / "horovod-build.json"
    check, calls = counting(False)
    for _ in range(2):
        assert horovodrun.remembered("gloo_built", check, "build-1", path)() is False
    assert len(calls) == 2 and not path.exists()
    check, calls = counting(True)
    for _ in range(2):
        horovodrun.remembered("gloo_built", check, None, path)()
    assert len(calls) == 2


def test_the_build_key_names_the_installed_extension_and_tensorflow():
    key = horovodrun.build_key()
    assert "horovod/tensorflow/mpi_lib" in key and "libtensorflow_framework" in key
