"""What tigon says of the releases of torch, triton, transformers, PEFT and TRL it meets."""

import warnings

import pytest

from tigon import UntestedVersionWarning, _versions as versions
from tigon._versions import TESTED, check_interpreter_numpy, release, warn_if_newer


@pytest.mark.parametrize(
    "version, expected", [("2.14.1+cu130", (2, 14)), ("5.25.0.dev0", (5, 25)), ("3", (3, 0)), ("2.4.6", (2, 4))]
)
def test_release_is_major_and_minor(version, expected):
    assert release(version) == expected


@pytest.mark.parametrize("package", sorted(TESTED))
def test_tested_releases_run_quietly_and_newer_ones_warn(package):
    (_, _), (major, minor) = TESTED[package]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_newer(package, f"{major}.{minor}.9")
    with pytest.warns(UntestedVersionWarning, match=f"tested with {package} {versions.tested_range(package)}, and {package} "
                      f"{major}.{minor + 1}.0 is installed: tigon runs with it"):
        assert warn_if_newer(package, f"{major}.{minor + 1}.0")


def test_an_absent_package_is_not_warned_of(monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda package: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_newer("peft")


@pytest.mark.parametrize("triton, numpy, refused", [
    ("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.8.0", "2.4.6", False), ("3.5.1", "2.4.0", True),
])
def test_numpy_too_new_for_the_interpreter_is_refused_up_front(triton, numpy, refused):
    if refused:
        with pytest.raises(ImportError, match=f'Triton {triton}\'s interpreter fails with numpy {numpy}: install numpy below 2.4'):
            check_interpreter_numpy(triton, numpy)
    else:
        check_interpreter_numpy(triton, numpy)
