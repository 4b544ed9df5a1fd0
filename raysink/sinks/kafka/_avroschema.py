"""An Avro record schema, read and checked once on the driver, for ``_avro`` to encode by.

``KafkaSink(value_format="avro", avro_schema=...)`` gives a record schema (a dict or its
JSON text); ``parse`` turns it into ``AvroValues``: the record's fields in order, each with
what a column must hold for it. Supported field types: ``null``, ``boolean``, ``int``,
``long``, ``float``, ``double``, ``bytes``, ``string``, ``enum``, ``fixed``, the logical
types ``date``, ``time-millis``, ``time-micros``, ``timestamp-millis``,
``timestamp-micros``, ``local-timestamp-millis``, ``local-timestamp-micros``, ``decimal``
(on ``bytes`` or ``fixed``) and ``uuid``, each alone or in a union with ``null`` (a nullable
column). Arrays, maps, nested records and other unions are refused here, naming the field:
encode such a value yourself into a binary column and pass it with ``value=``.

A logical type on the wrong underlying type, or an invalid decimal, is ignored, as the
Avro specification says (the field is its underlying type). A field's default is encoded
here, once: a batch without the field's column gets it in every record. No Avro library is
used: the schema subset above is small, and the encoder needs its own view of it anyway.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raysink.errors import ConfigError

__all__ = ["AvroField", "AvroType", "AvroValues", "parse", "zigzag"]

PRIMITIVES = ("null", "boolean", "int", "long", "float", "double", "bytes", "string")
_LOGICAL = {  # logical type -> the underlying types it may annotate
    "date": ("int",), "time-millis": ("int",), "time-micros": ("long",),
    "timestamp-millis": ("long",), "timestamp-micros": ("long",),
    "local-timestamp-millis": ("long",), "local-timestamp-micros": ("long",),
    "decimal": ("bytes", "fixed"), "uuid": ("string",),
}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_REFUSED_HINT = ("raysink encodes Avro records of primitive, enum, fixed and logical "
                 "fields (each may be nullable: a union with \"null\"); encode this value "
                 "yourself into a binary column and pass it with value=, or flatten it into "
                 "fields of those types")


@dataclass(frozen=True, slots=True)
class AvroType:
    """One non-union Avro type: ``kind`` a primitive, ``enum`` or ``fixed``; ``logical``
    its logical type where valid (``None`` else)."""

    kind: str
    logical: str | None = None
    symbols: tuple[str, ...] = ()
    size: int = 0
    precision: int = 0
    scale: int = 0


@dataclass(frozen=True, slots=True)
class AvroField:
    """A field of the record: its type, whether it is a union with ``null`` (and the
    branch index of ``null`` in it), and its default encoded (``None``: no default)."""

    name: str
    type: AvroType
    nullable: bool = False
    null_branch: int = 0
    default: bytes | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class AvroValues:
    """Record values in Avro: the schema (its JSON text, as given), its fields, and the
    Confluent Schema Registry id to frame each value with (``None``: plain Avro binary)."""

    schema: str
    fields: tuple[AvroField, ...]
    schema_id: int | None = None

    @property
    def prefix(self) -> bytes:
        """What precedes each value's body: the wire format's magic byte 0 and the schema
        id as 4 big-endian bytes, or nothing."""
        if self.schema_id is None:
            return b""
        return b"\x00" + self.schema_id.to_bytes(4, "big")


def parse(schema: Mapping[str, Any] | str, schema_id: int | None = None) -> AvroValues:
    """``schema`` checked and read; ``ConfigError`` naming the field and what to change."""
    text = schema if isinstance(schema, str) else None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ConfigError(f"avro_schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, Mapping) or schema.get("type") != "record":
        raise ConfigError("avro_schema must be an Avro record schema ({\"type\": \"record\", "
                          f"\"name\": ..., \"fields\": [...]}}); got {schema!r:.200}")
    fields = schema.get("fields")
    if not isinstance(fields, list) or not fields:
        raise ConfigError(f"avro_schema must list its fields; got fields={fields!r:.200}")
    if schema_id is not None and (isinstance(schema_id, bool) or not isinstance(schema_id, int)
                                  or not 0 <= schema_id < 2**31):
        raise ConfigError("schema_id must be a Schema Registry id (0 to 2**31-1) or None; "
                          f"got {schema_id!r}")
    names = _Names(str(schema.get("namespace", "")))
    parsed = tuple(_field(f, names) for f in fields)
    seen = [f.name for f in parsed]
    if len(set(seen)) != len(seen):
        raise ConfigError(f"avro_schema names a field twice: {seen}")
    return AvroValues(schema=text if text is not None else json.dumps(schema),
                      fields=parsed, schema_id=schema_id)


class _Names:
    """Named types (enum, fixed) defined so far, by full and short name, for reuse."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.types: dict[str, AvroType] = {}

    def define(self, spec: Mapping[str, Any], kind: AvroType) -> None:
        name = str(spec.get("name", ""))
        space = str(spec.get("namespace", self.namespace))
        full = name if "." in name or not space else f"{space}.{name}"
        self.types[full] = kind
        self.types.setdefault(full.rsplit(".", 1)[-1], kind)

    def get(self, name: str) -> AvroType | None:
        return self.types.get(name)


def _field(spec: Any, names: _Names) -> AvroField:
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) \
            or not _NAME.match(spec["name"]):
        raise ConfigError(f"each field of avro_schema needs a name (letters, digits, _) and "
                          f"a type; got {spec!r:.200}")
    name = spec["name"]
    declared = spec.get("type")
    nullable, null_branch, kind = False, 0, declared
    if isinstance(declared, list):
        nullable, null_branch, kind = _union(name, declared)
    avro = _type(name, kind, names)
    field = AvroField(name=name, type=avro, nullable=nullable, null_branch=null_branch)
    if "default" not in spec:
        return field
    try:
        default = _default(field, spec["default"])
    except (TypeError, ValueError, OverflowError, struct.error) as exc:
        raise ConfigError(f"field {name!r} of avro_schema: its default {spec['default']!r} "
                          f"does not fit its type ({exc})") from None
    return AvroField(name=name, type=avro, nullable=nullable, null_branch=null_branch,
                     default=default)


def _union(name: str, branches: list[Any]) -> tuple[bool, int, Any]:
    """``[T]``, ``["null", T]`` or ``[T, "null"]``: (nullable, null's branch, T)."""
    others = [b for b in branches if b != "null"]
    if len(branches) == 1:
        return False, 0, branches[0]
    if len(branches) == 2 and len(others) == 1:
        return True, branches.index("null"), others[0]
    raise ConfigError(f"field {name!r} of avro_schema is the union {branches!r}: only a "
                      f"type alone or with \"null\" is supported; {_REFUSED_HINT}")


def _type(name: str, spec: Any, names: _Names) -> AvroType:
    if isinstance(spec, str):
        if spec in PRIMITIVES:
            return AvroType(spec)
        named = names.get(spec)
        if named is None:
            raise ConfigError(f"field {name!r} of avro_schema has the type {spec!r}, which "
                              "is no Avro primitive nor an enum or fixed defined before it")
        return named
    if not isinstance(spec, Mapping):
        raise ConfigError(f"field {name!r} of avro_schema: {spec!r:.200} is not an Avro "
                          f"type; {_REFUSED_HINT}")
    kind = spec.get("type")
    if kind in ("array", "map", "record", "error") or isinstance(kind, list | Mapping):
        raise ConfigError(f"field {name!r} of avro_schema is of type {kind!r}; "
                          f"{_REFUSED_HINT}")
    if kind == "enum":
        symbols = spec.get("symbols")
        if not isinstance(symbols, list) or not symbols or not all(
                isinstance(s, str) and _NAME.match(s) for s in symbols) \
                or len(set(symbols)) != len(symbols):
            raise ConfigError(f"field {name!r} of avro_schema: an enum needs distinct "
                              f"symbols (names); got {symbols!r:.200}")
        avro = AvroType("enum", symbols=tuple(symbols))
        names.define(spec, avro)
        return avro
    if kind == "fixed":
        size = spec.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ConfigError(f"field {name!r} of avro_schema: a fixed needs a size; got "
                              f"{size!r}")
        avro = _logical(AvroType("fixed", size=size), spec)
        names.define(spec, avro)
        return avro
    if kind in PRIMITIVES:
        return _logical(AvroType(str(kind)), spec)
    raise ConfigError(f"field {name!r} of avro_schema has the type {kind!r}; "
                      f"{_REFUSED_HINT}")


def _logical(base: AvroType, spec: Mapping[str, Any]) -> AvroType:
    """``base`` with its logical type, where the specification makes it valid."""
    logical = spec.get("logicalType")
    if logical not in _LOGICAL or base.kind not in _LOGICAL[logical]:
        return base
    if logical != "decimal":
        return AvroType(base.kind, logical, size=base.size)
    precision, scale = spec.get("precision"), spec.get("scale", 0)
    if not (isinstance(precision, int) and isinstance(scale, int) and precision > 0
            and 0 <= scale <= precision):
        return base
    if base.kind == "fixed" and precision > _fixed_digits(base.size):
        return base
    return AvroType(base.kind, "decimal", size=base.size, precision=precision, scale=scale)


def _fixed_digits(size: int) -> int:
    """The most decimal digits a two's-complement number of ``size`` bytes holds."""
    return len(str(2 ** (8 * size - 1) - 1)) - 1 if size else 0


# -- defaults, encoded once ------------------------------------------------------------


def zigzag(value: int) -> bytes:
    """One ``int``/``long`` in Avro's variable-length zigzag encoding."""
    if not -2**63 <= value < 2**63:
        raise OverflowError(f"{value} is outside a long")
    number = (value << 1) ^ (value >> 63)
    out = bytearray()
    while number > 0x7F:
        out.append((number & 0x7F) | 0x80)
        number >>= 7
    out.append(number)
    return bytes(out)


def _default(field: AvroField, value: Any) -> bytes:
    """A field's default in binary. Per the specification a union's default is of its
    first branch, and a default is in the JSON form of the underlying type (bytes and
    fixed as strings of code points 0-255)."""
    if not field.nullable:
        return _plain(field.type, value)
    if field.null_branch == 0:
        if value is not None:
            raise ValueError("a union's default is of its first branch, here null")
        return zigzag(0)
    return zigzag(0) + _plain(field.type, value)


def _plain(avro: AvroType, value: Any) -> bytes:
    kind = avro.kind
    if kind == "null":
        if value is not None:
            raise ValueError("null's default is null")
        return b""
    if kind == "boolean":
        if not isinstance(value, bool):
            raise TypeError("a boolean")
        return b"\x01" if value else b"\x00"
    if kind in ("int", "long"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError("an integer")
        if kind == "int" and not -2**31 <= value < 2**31:
            raise OverflowError(f"{value} is outside an int")
        return zigzag(value)
    if kind in ("float", "double"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError("a number")
        return struct.pack("<f" if kind == "float" else "<d", float(value))
    if kind == "enum":
        return zigzag(avro.symbols.index(value))
    if not isinstance(value, str):
        raise TypeError("a string")
    data = value.encode("utf-8") if kind == "string" else value.encode("latin-1")
    if kind == "fixed":
        if len(data) != avro.size:
            raise ValueError(f"a fixed of {avro.size} bytes")
        return data
    return zigzag(len(data)) + data
