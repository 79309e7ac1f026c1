"""Whether this process can reach a run's blob store, and if not, which setting is missing.

Every process of a run reads and writes the store: ``runtime.up`` where it runs, each actor process on its
node, with the credentials that node has (boto3's environment variables, profile files or instance role:
nothing carries ``runtime.up``'s to a Ray node). `probe_store` makes the one request they all make first
(listing the run's prefix) and says in an operator's words what stops it, so that a start fails once, before
any actor runs, instead of every actor process crashing on its first request.

Standard library and boto3 only: the Ray backend ships this module by value (cloudpickle) to probe each node
(runtime.ray_backend), as it ships runtime.ray_host.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CREDENTIAL_SETTINGS", "probe_store"]

CREDENTIAL_SETTINGS = ("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment (or AWS_PROFILE with a "
                       "credentials file, or an instance role)")
PROBE_TIMEOUT_S = 10.0  # connect and read, per attempt: a probe answers within seconds or names the endpoint
_REFUSED_CREDENTIALS = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                                  "InvalidClientTokenId", "AuthFailure"})


def probe_store(url: str, s3_endpoint: str = "") -> str:
    """What stops this process from listing the store at ``url``, empty when nothing does.

    A ``file://`` store needs no credentials: it is not probed. For ``s3://bucket/prefix`` the message names
    the missing or refused setting (the credentials, ``storage.s3_endpoint``, the bucket).
    """
    if not url.startswith("s3://"):
        return ""
    import boto3
    import botocore.config
    import botocore.exceptions

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    session = boto3.session.Session()
    if session.get_credentials() is None:
        return f"no S3 credentials: set {CREDENTIAL_SETTINGS}"
    config = botocore.config.Config(connect_timeout=PROBE_TIMEOUT_S, read_timeout=PROBE_TIMEOUT_S,
                                    retries={"total_max_attempts": 2, "mode": "standard"},
                                    s3={"addressing_style": "path" if s3_endpoint else "auto"})
    where = f"storage.s3_endpoint={s3_endpoint}" if s3_endpoint else "AWS's endpoint (storage.s3_endpoint empty)"
    try:
        client: Any = session.client("s3", endpoint_url=s3_endpoint or None, config=config)
        client.list_objects_v2(Bucket=bucket, Prefix=prefix.strip("/"), MaxKeys=1)
    except botocore.exceptions.NoCredentialsError:
        return f"no S3 credentials: set {CREDENTIAL_SETTINGS}"
    except botocore.exceptions.PartialCredentialsError as e:
        return f"incomplete S3 credentials ({e}): set {CREDENTIAL_SETTINGS}"
    except botocore.exceptions.ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code in _REFUSED_CREDENTIALS:
            return f"S3 refused the credentials ({code}): set the store's own {CREDENTIAL_SETTINGS}"
        if code == "NoSuchBucket":
            return f"bucket {bucket!r} does not exist at {where}: create it, or fix storage.url"
        if code in ("AccessDenied", "403", "AllAccessDisabled"):
            return (f"the credentials may not list s3://{bucket}/{prefix} ({code}): grant them s3:ListBucket, "
                    "GetObject, PutObject and DeleteObject there")
        return f"listing s3://{bucket}/{prefix} failed ({code or e}); check storage.url and {where}"
    except botocore.exceptions.EndpointConnectionError as e:
        return f"cannot connect to {where} ({e}): fix storage.s3_endpoint or the network"
    except (botocore.exceptions.BotoCoreError, ValueError) as e:
        return f"the S3 request failed ({type(e).__name__}: {e}); check storage.url and {where}"
    return ""
