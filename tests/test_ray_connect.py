"""A Ray cluster address nobody answers at (issue #31, item 6): ``RayDispatcher`` raises an error
naming the address within seconds, instead of hanging in ``ray.init`` for minutes (Ray's own GCS
connect retries in C++, deaf to SIGTERM). The error is a ``ConnectionError``: the CLI's ``run``
and ``doctor`` report it as an infrastructure failure, exit 3."""

from __future__ import annotations

import socket
import time

import pytest
from typer.testing import CliRunner

pytest.importorskip("ray")

from autotune.dispatch.ray_dispatch import RayDispatcher, RayUnreachable  # noqa: E402


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(autouse=True)
def no_ray_running():
    import ray

    if ray.is_initialized():  # a Ray left by another test in this process would be reused, not dialled
        ray.shutdown()
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_a_closed_port_fails_fast_naming_the_address(scheme):
    address = f"{scheme}127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(ConnectionError) as caught:
        RayDispatcher(address=address)
    assert isinstance(caught.value, RayUnreachable)
    assert not isinstance(caught.value, ValueError)  # run maps ValueError to exit 2 (a bad spec)
    assert address in str(caught.value)
    print(f"{address}: failed after {time.monotonic() - started:.1f} s")  # seen: ~10 s; was > 330 s


@pytest.mark.timeout(90)
def test_doctor_exits_3_naming_the_address():
    from autotune.cli.commands import app

    address = f"127.0.0.1:{closed_port()}"
    result = CliRunner().invoke(app, ["doctor", "--ray-address", address])
    assert result.exit_code == 3, result.output
    assert address in result.output


@pytest.mark.timeout(120)
@pytest.mark.parametrize("calibrate", ["never", "auto"])
def test_run_exits_3_naming_the_address(write_spec, tmp_path, monkeypatch, calibrate):
    """``autotune run`` against a dead cluster: exit 3 (infrastructure) and one line naming the
    address, nothing probed; was a silent hang of minutes."""
    from autotune.cli.commands import app
    from autotune.study.host_profile import PROFILE_CACHE_ENV
    from support import command_spec, probe_log

    # with calibration on (the default where no profile is cached) the host profile's own Ray
    # connection comes first: it fails as fast, with the same words
    monkeypatch.setenv("AUTOTUNE_CALIBRATE", calibrate)
    monkeypatch.setenv(PROFILE_CACHE_ENV, str(tmp_path / "profiles"))  # nothing cached: it calibrates
    address = f"127.0.0.1:{closed_port()}"
    spec = command_spec(write_spec, tmp_path, n_trials=2, parallel=1, ray="")
    result = CliRunner().invoke(
        app, ["run", str(spec), "--run-dir", str(tmp_path / "run"), "--no-tracking", "--ray-address", address]
    )
    assert result.exit_code == 3, result.output
    assert address in result.output
    assert "Traceback" not in result.output
    assert probe_log(tmp_path) == []
