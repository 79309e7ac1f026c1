"""Fixtures for tests that talk to a real S3 server (moto's, over HTTP), shared through pytest_plugins.

Modules that use them mark themselves with ``pytestmark = pytest.mark.usefixtures("aws_env")`` so that
boto3 finds credentials without touching the machine's real ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from runtime.blob.testing import FaultProxy, MotoServer


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    with MotoServer() as server:
        yield server


@pytest.fixture(scope="module")
def proxy(moto: MotoServer) -> Iterator[FaultProxy]:
    with FaultProxy(moto.endpoint) as fault_proxy:
        yield fault_proxy


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
