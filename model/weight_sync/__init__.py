"""Weight sync: trainer ranks -> blob store -> rollout actors, as delta chains with anchors.

Each step, every publishing rank encodes its part of the state dict as the XOR (or overwrite) of
the raw bits against its previous upload, zstd-compressed, with per-tensor checksums; every K
versions a full anchor. Readers replay the chain from the version they hold or jump to the newest
anchor, verify every step, and assemble all ranks' parts. Modules, one concept each:

- ``codec``: one tensor's delta encoding (XOR / sparse XOR / overwrite, zstd, xxh3 checksums);
- ``manifest``: the key layout and the manifest describing one rank's part of a version;
- ``version``: encode/decode one rank's part of a version (shards + manifest);
- ``sharding``: splitting a state dict across ranks and assembling the parts;
- ``publisher``: background encoding and upload, retries, retention GC;
- ``subscriber``: fetch, replay, verify, assemble.

This package is single-process library code: it takes any object with async ``put/get/list/delete``
(``runtime.blob.BlobStore`` fits) and never imports the runtime.

The package's own names are the torch-free modules' (errors, manifest, sharding, store): whoever only reads
manifests and announcements (the reconciler, checking a weights announcement) imports no torch through it.
The codec, version, publisher and subscriber, which need torch, are imported from their modules.
"""

from model.weight_sync.errors import (
    BaseMismatch,
    CorruptVersion,
    IncompleteVersion,
    PublishFailed,
    VersionUnavailable,
    WeightSyncError,
)
from model.weight_sync.manifest import FORMAT, Manifest, ShardEntry, TensorEntry, manifest_key
from model.weight_sync.sharding import assemble, partition, rank_part
from model.weight_sync.store import BlobStoreLike

__all__ = [
    "FORMAT",
    "BaseMismatch",
    "BlobStoreLike",
    "CorruptVersion",
    "IncompleteVersion",
    "Manifest",
    "PublishFailed",
    "ShardEntry",
    "TensorEntry",
    "VersionUnavailable",
    "WeightSyncError",
    "assemble",
    "manifest_key",
    "partition",
    "rank_part",
]
