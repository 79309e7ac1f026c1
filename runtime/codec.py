"""Typed messages on the wire: msgpack maps with a schema version and a type, validated on receipt.

    envelope = {"schema": 1, "type": "<message type>", "v": <type version>, "body": {...}}
             | {"schema": 1, "type": ..., "v": ..., "blob": "<key>", "size": <bytes>}

Bodies larger than ``inline_limit_bytes`` travel through blob storage by key, so NATS only ever carries
small messages. Bodies are msgspec's: encoded from, and decoded with validation into, the message's type
(a frozen dataclass or a msgspec Struct; a dataclass's unknown fields are refused at any depth, as a
Struct's with ``forbid_unknown_fields``). Anything that fails to decode raises ``MessageError`` with a
short reason code and the field at fault, which the actor base turns into a dead-letter entry.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import msgspec

from runtime.errors import MessageError
from runtime.validation import enum_choices, hint_at, split_error, strict_shape

SCHEMA_VERSION = 1
_ENCODER = msgspec.msgpack.Encoder()  # dataclasses and Structs as maps by field name, enums by value
_SHA256_RE = re.compile(r"[0-9a-f]{64}")

M = TypeVar("M", bound="Message")


class Message:
    """Base of every message type: a frozen dataclass with a wire ``TYPE`` name and a ``VERSION``."""

    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1


def message(type_name: str, version: int = 1) -> typing.Callable[[type[M]], type[M]]:
    """Class decorator: makes a frozen, slotted dataclass message with its wire type and version."""

    def wrap(cls: type[M]) -> type[M]:
        cls = dataclass(frozen=True, slots=True)(cls)
        cls.TYPE = type_name
        cls.VERSION = version
        return cls

    return wrap


class BlobPutGet(Protocol):
    async def put(self, key: str, data: bytes) -> None: ...
    async def get(self, key: str) -> bytes: ...


@dataclass(frozen=True)
class CodecLimits:
    inline_limit_bytes: int = 256 * 1024
    max_message_bytes: int = 1024 * 1024  # an inline message above this is rejected as oversized

    def __post_init__(self) -> None:
        if not 0 < self.inline_limit_bytes <= self.max_message_bytes:
            raise ValueError(f"need 0 < inline_limit_bytes ({self.inline_limit_bytes}) <= "
                             f"max_message_bytes ({self.max_message_bytes})")


class Codec:
    """Encodes and decodes one set of message types; unknown types are rejected on receipt."""

    def __init__(self, types_: Iterable[type] | Mapping[str, type], blob: BlobPutGet | None = None,
                 limits: CodecLimits = CodecLimits(), blob_prefix: str = "messages") -> None:
        """``types_``: ``@message`` classes, or a mapping of wire name to any frozen dataclass."""
        pairs = types_.items() if isinstance(types_, Mapping) else ((getattr(t, "TYPE", ""), t) for t in types_)
        self._types: dict[str, type] = {}
        self._names: dict[type, str] = {}
        for name, t in pairs:
            if not name or not (dataclasses.is_dataclass(t) or issubclass(t, msgspec.Struct)):
                raise TypeError(f"{t.__name__} is not a message: decorate it with @message(...) or give "
                                "the codec a mapping of wire name to frozen dataclass or msgspec Struct")
            if issubclass(t, msgspec.Struct) and not t.__struct_config__.forbid_unknown_fields:
                raise TypeError(f"{t.__name__} would take unknown fields silently: declare it with "
                                "forbid_unknown_fields=True, as every message type refuses them")
            if name in self._types and self._types[name] is not t:
                raise TypeError(f"message type {name!r} registered twice "
                                f"({self._types[name].__name__} and {t.__name__})")
            self._types[name] = t
            self._names[t] = name
            _decoders(t)  # built here, once: not on the first message
        self._blob = blob
        self.limits = limits
        self._blob_prefix = blob_prefix

    @property
    def type_names(self) -> list[str]:
        return sorted(self._types)

    async def encode(self, msg: Any) -> bytes:
        name = self._names.get(type(msg))
        if name is None:
            raise TypeError(f"{type(msg).__name__} is not one of this codec's types: {self.type_names}")
        body = _ENCODER.encode(msg)
        head = {"schema": SCHEMA_VERSION, "type": name, "v": _version(type(msg))}
        if len(body) > self.limits.inline_limit_bytes:
            if self._blob is None:
                raise ValueError(f"{name} body is {len(body)} bytes, above the inline limit "
                                 f"{self.limits.inline_limit_bytes}, and this codec has no blob store")
            key = f"{self._blob_prefix}/{name}/{hashlib.sha256(body).hexdigest()}"
            await self._blob.put(key, body)
            return _ENCODER.encode({**head, "blob": key, "size": len(body)})
        return _ENCODER.encode({**head, "body": body})

    async def decode(self, data: bytes) -> Any:
        """The message ``data`` carries.

        Raises:
            MessageError: whatever is wrong with the message itself, whichever exception found it (a
                ``type`` that is a list, a blob key that escapes the store, a body whose dataclass
                refuses it): such a message can never decode, and its receiver dead-letters it.
            OSError: the blob store could not be read (an outage, not the message's fault: retry).
        """
        try:
            return await self._decode(data)
        except (MessageError, OSError):
            raise
        except Exception as e:  # any other failure here is the message's: say which
            raise MessageError("malformed", f"{type(e).__name__}: {e}") from e

    async def _decode(self, data: bytes) -> Any:
        if len(data) > self.limits.max_message_bytes:
            raise MessageError("oversized", f"{len(data)} bytes > limit {self.limits.max_message_bytes}; "
                               "large payloads must travel through blob storage")
        try:
            env = msgspec.msgpack.decode(data)
        except msgspec.DecodeError as e:
            raise MessageError("malformed", f"not msgpack: {e}") from None
        if not isinstance(env, dict) or env.get("schema") != SCHEMA_VERSION:
            raise MessageError("malformed", f"not an envelope of schema {SCHEMA_VERSION}")
        name = env.get("type")
        cls = self._types.get(name) if isinstance(name, str) else None  # a map or list is no type name
        if cls is None:
            raise MessageError("unknown_type", f"type {name!r} not in {self.type_names}")
        if env.get("v") != _version(cls):
            raise MessageError("version_mismatch", f"{name} v{env.get('v')} != expected v{_version(cls)}")
        body = await self._body(env, str(name))
        return _from_wire(cls, body, str(name))

    async def _body(self, env: dict[str, Any], name: str) -> bytes:
        if "body" in env and isinstance(env["body"], bytes):
            return env["body"]
        if "blob" in env and isinstance(env["blob"], str):
            key = env["blob"]
            digest = key.rpartition("/")[2]
            # only a key this codec would write (prefix/type/sha256 of the body): nothing else of the
            # store is read, and the body must hash to its key
            if key != f"{self._blob_prefix}/{name}/{digest}" or not _SHA256_RE.fullmatch(digest):
                raise MessageError("invalid_blob_key",
                                   f"blob key {key[:200]!r} is not {self._blob_prefix}/{name}/<sha256>")
            if self._blob is None:
                raise MessageError("blob_unavailable", f"message body at {key!r}, but no blob store")
            try:
                body = await self._blob.get(key)
            except KeyError:
                raise MessageError("blob_missing", f"message body {key!r} not in storage") from None
            except ValueError as e:  # the store refused the key itself (absolute, '..', reserved)
                raise MessageError("invalid_blob_key", str(e)) from None
            if hashlib.sha256(body).hexdigest() != digest:
                raise MessageError("invalid", f"message body at {key!r} does not hash to its key")
            return body
        raise MessageError("malformed", "envelope has neither body nor blob")


@functools.cache
def _decoders(cls: type) -> tuple[msgspec.msgpack.Decoder | None, msgspec.msgpack.Decoder]:
    """A message class's decoders, built once: the unknown-field check (None for a msgspec Struct, which
    refuses unknown fields itself if it is so declared) and the typed decoder."""
    typed = msgspec.msgpack.Decoder(cls)
    if issubclass(cls, msgspec.Struct):
        return None, typed
    return msgspec.msgpack.Decoder(strict_shape(cls)), typed


def _from_wire(cls: type, body: bytes, name: str) -> Any:
    shape, typed = _decoders(cls)
    try:
        if shape is not None:
            shape.decode(body)
        return typed.decode(body)
    except msgspec.ValidationError as e:
        raise MessageError("invalid", f"body of {name} cannot be a {cls.__name__}: {_say(e, cls)}") from None
    except msgspec.DecodeError as e:
        raise MessageError("malformed", f"body of {name} is not msgpack: {e}") from None


def _say(error: msgspec.ValidationError, cls: type) -> str:
    what, path = split_error(error)
    if what.startswith("invalid enum value") and (choices := enum_choices(hint := hint_at(cls, path))):
        what = f"{what.removeprefix('invalid enum value ')} is not a {hint.__name__} (one of {choices})"
    return f"{path}: {what}" if path else what


def _version(cls: type) -> int:
    return int(getattr(cls, "VERSION", 1))
