"""Typed messages on the wire: msgpack maps with a schema version and a type, validated on receipt.

    envelope = {"schema": 1, "type": "<message type>", "v": <type version>, "body": {...}}
             | {"schema": 1, "type": ..., "v": ..., "blob": "<key>", "size": <bytes>}

Bodies larger than ``inline_limit_bytes`` travel through blob storage by key, so NATS only ever carries
small messages. Anything that fails to decode raises ``MessageError`` with a short reason code, which
the actor base turns into a dead-letter entry.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import re
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import msgpack

from runtime.errors import MessageError

SCHEMA_VERSION = 1
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
            if not name or not dataclasses.is_dataclass(t):
                raise TypeError(f"{t.__name__} is not a message: decorate it with @message(...) "
                                "or give the codec a mapping of wire name to dataclass")
            if name in self._types and self._types[name] is not t:
                raise TypeError(f"message type {name!r} registered twice "
                                f"({self._types[name].__name__} and {t.__name__})")
            self._types[name] = t
            self._names[t] = name
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
        body = msgpack.packb(_to_wire(msg), use_bin_type=True)
        head = {"schema": SCHEMA_VERSION, "type": name, "v": _version(type(msg))}
        if len(body) > self.limits.inline_limit_bytes:
            if self._blob is None:
                raise ValueError(f"{name} body is {len(body)} bytes, above the inline limit "
                                 f"{self.limits.inline_limit_bytes}, and this codec has no blob store")
            key = f"{self._blob_prefix}/{name}/{hashlib.sha256(body).hexdigest()}"
            await self._blob.put(key, body)
            return msgpack.packb({**head, "blob": key, "size": len(body)}, use_bin_type=True)
        return msgpack.packb({**head, "body": body}, use_bin_type=True)

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
            env = msgpack.unpackb(data, raw=False)
        except Exception as e:  # msgpack raises several unrelated types
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
        try:
            fields = msgpack.unpackb(body, raw=False)
        except Exception as e:
            raise MessageError("malformed", f"body of {name} is not msgpack: {e}") from None
        try:
            return _from_wire(cls, fields, str(name))
        except MessageError:
            raise
        except (TypeError, ValueError, KeyError, RecursionError) as e:  # whatever the body holds, never a crash
            raise MessageError("invalid", f"body of {name} cannot be a {cls.__name__}: {e!r}") from None

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
def _type_hints(cls: type) -> dict[str, Any]:
    """Resolved field types of a message class; resolving them per message was a tenth of decode time."""
    return typing.get_type_hints(cls)


@functools.cache
def _wire_fields(cls: type) -> tuple[frozenset[str], tuple[tuple[str, Any, bool], ...]]:
    """A message class's init field names, and (name, type, required) per field, computed once:
    ``dataclasses.fields`` per message was another tenth of decode time."""
    hints = _type_hints(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    names = frozenset(f.name for f in fields if f.init)
    missing = dataclasses.MISSING
    return names, tuple(
        (f.name, hints[f.name], f.default is missing and f.default_factory is missing) for f in fields
    )


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]


def _version(cls: type) -> int:
    return int(getattr(cls, "VERSION", 1))


def _to_wire(msg: Any) -> Any:
    if dataclasses.is_dataclass(msg) and not isinstance(msg, type):
        return {name: _to_wire(getattr(msg, name)) for name in _field_names(type(msg))}
    if isinstance(msg, enum.Enum):
        return msg.value
    if isinstance(msg, tuple | list):
        return [_to_wire(x) for x in msg]
    if isinstance(msg, dict):
        return {k: _to_wire(v) for k, v in msg.items()}
    return msg


def _from_wire(cls: type[M], fields: Any, path: str) -> M:
    if not isinstance(fields, dict):
        raise MessageError("invalid", f"{path}: expected a map, got {type(fields).__name__}")
    names, wire_fields = _wire_fields(cls)
    unknown = set(fields) - names
    if unknown:
        raise MessageError("invalid", f"{path}: unknown fields {sorted(unknown)}")
    kwargs = {}
    for name, hint, required in wire_fields:
        if name in fields:
            kwargs[name] = _check(fields[name], hint, f"{path}.{name}")
        elif required:
            raise MessageError("invalid", f"{path}: missing field {name!r}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise MessageError("invalid", f"{path}: {e}") from None


def _check(value: Any, hint: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check(value, arg, path)
            except MessageError:
                continue
        raise MessageError("invalid", f"{path}: {value!r} matches none of {hint}")
    if dataclasses.is_dataclass(hint):
        return _from_wire(hint, value, path)  # type: ignore[arg-type]
    if origin is tuple or origin is list:
        if not isinstance(value, list | tuple):
            raise MessageError("invalid", f"{path}: expected a list, got {type(value).__name__}")
        args = typing.get_args(hint)
        item = args[0] if args else Any
        items = [_check(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        kt, vt = typing.get_args(hint) or (Any, Any)
        if not isinstance(value, dict):
            raise MessageError("invalid", f"{path}: expected a map, got {type(value).__name__}")
        return {_check(k, kt, path): _check(v, vt, f"{path}[{k!r}]") for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise MessageError("invalid", f"{path}: {value!r} is not a {hint.__name__}") from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is type(None) and value is None:
        return None
    if isinstance(hint, type) and hint in (int, float, str, bytes, bool):
        if type(value) is not hint:
            raise MessageError("invalid", f"{path}: expected {hint.__name__}, got {type(value).__name__}")
        return value
    raise MessageError("invalid", f"{path}: unsupported field type {hint}")
