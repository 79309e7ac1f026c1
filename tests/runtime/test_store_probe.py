"""runtime.store_probe against moto's S3 server: each thing that stops a process from listing the store is
named with the setting to fix, and a store it can list gives nothing to say."""

from __future__ import annotations

import socket

import boto3
import pytest

from runtime.blob import BlobError, open_store
from runtime.blob.testing import MotoServer
from runtime.store_probe import probe_store


@pytest.mark.usefixtures("aws_env")
def test_each_obstacle_names_its_setting(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    boto3.client("s3", endpoint_url=moto.endpoint).create_bucket(Bucket="probed")
    assert probe_store("s3://probed/runs/r1", moto.endpoint) == ""
    assert probe_store("file:///nowhere/at/all") == "", "a file:// store needs no credentials"
    missing = probe_store("s3://absent/runs/r1", moto.endpoint)
    assert "bucket 'absent' does not exist" in missing and f"storage.s3_endpoint={moto.endpoint}" in missing
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert "cannot connect to storage.s3_endpoint=" in probe_store("s3://probed/r1", closed)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to find on a test machine
    assert probe_store("s3://probed/r1", moto.endpoint).startswith("no S3 credentials: set AWS_ACCESS_KEY_ID")


@pytest.mark.usefixtures("aws_env")
async def test_a_store_used_without_credentials_says_what_to_set(moto: MotoServer,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """What an actor process on a node without credentials meets (one that joined after the start's probe)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    async with open_store("s3://probed/r1", s3_endpoint=moto.endpoint) as store:
        with pytest.raises(BlobError, match="no S3 credentials where this process runs: set AWS_ACCESS_KEY_ID"):
            await store.get("run/record.json")
