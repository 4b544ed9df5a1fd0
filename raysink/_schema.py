"""The one codec for Arrow schemas that travel in manifests and commit requests, the one
way to say how two schemas differ, and the one set of rules for schema evolution.

A schema travels as text: base64 of its Arrow IPC form, with the schema-level metadata
dropped (pandas and Spark put large, irrelevant blobs there; field metadata, such as
Iceberg field ids, is kept). ``same`` compares what a table stores: names and types in
order, not metadata or nullability. ``differences`` lists, for a person, what keeps one
schema from being stored as another.

Schema evolution (``schema_evolution="add_columns"`` on every sink)::

    union(schemas)               the epoch's schema from its writers' (or one writer's
                                 batches'): every column of any of them, in first-seen
                                 order, each in the narrowest type all its types widen to
                                 without loss; nullable where any is, or where one lacks it
    evolve(current, incoming,    what a target of schema ``current`` becomes when it takes
           rules)                ``incoming``: new columns added (nullable), a column whose
                                 incoming type is a lossless widening of its type widened
                                 where ``rules`` allow it, a narrower incoming type kept
                                 (the data is cast up, ``conform``); anything else is a
                                 ``SchemaMismatchError`` naming the column
    conform(batch, target)       a batch cast up to the target's wider types
    refusal(current, incoming,   ``schema_evolution="fail"``: why ``incoming`` cannot be
            rules)               stored as ``current`` is (a ``SchemaMismatchError`` naming
                                 the first column at fault and what to change), or ``None``
    align(tables, target)        tables of an epoch as ONE table of the target's schema:
                                 its columns in order, missing ones null, cast up
    reported(manifests)          the schemas an epoch's manifests report, decoded
    united(manifests)            their union (``None`` when none reports one)

A lossless widening (``lossless``) is a cast Arrow makes without losing any value: a
wider integer of the same signedness (or a signed one wider than an unsigned one), a
wider float, a decimal of the same scale with more precision; ``canonical`` forms
(dictionary, large and view strings and binaries) count as their plain type. Each target
says through its ``Rules`` what it stores as one type (``key``: Delta's, Iceberg's,
PostgreSQL's type names) and which widenings it can apply to a column it holds
(``widen``): the coordinator checks an epoch against the epochs decided before it with the
same rules, so a commit never meets a change its target refuses.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import pyarrow as pa

from raysink.errors import ConfigError, SchemaMismatchError

__all__ = [
    "EVOLUTIONS",
    "Evolution",
    "Rules",
    "SchemaEvolution",
    "admit",
    "align",
    "canonical",
    "check_evolution_option",
    "common_type",
    "conform",
    "conformed",
    "decode",
    "describe",
    "differences",
    "encode",
    "evolve",
    "loosen",
    "lossless",
    "refusal",
    "reported",
    "same",
    "union",
    "united",
]

_Data = TypeVar("_Data", pa.RecordBatch, pa.Table)

SchemaEvolution = Literal["fail", "add_columns"]
EVOLUTIONS: tuple[SchemaEvolution, ...] = ("fail", "add_columns")


def encode(schema: pa.Schema) -> str:
    """Base64 of the Arrow IPC schema, without schema-level metadata (JSON-safe)."""
    return base64.b64encode(schema.remove_metadata().serialize().to_pybytes()).decode("ascii")


def decode(text: str) -> pa.Schema:
    """The schema ``encode`` wrote."""
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def same(a: pa.Schema, b: pa.Schema) -> bool:
    """Equal names and types in order, ignoring metadata and nullability."""
    return a.names == b.names and all(x.type == y.type for x, y in zip(a, b, strict=True))


def differences(expected: pa.Schema, actual: pa.Schema) -> list[str]:
    """What keeps ``actual`` from being stored as ``expected``; empty when nothing does.

    A non-nullable column where a nullable one is expected is compatible (widening)."""
    want = {f.name: f for f in expected}
    got = {f.name: f for f in actual}
    diffs: list[str] = []
    missing = [name for name in want if name not in got]
    extra = [name for name in got if name not in want]
    if missing:
        diffs.append(f"missing columns {missing}")
    if extra:
        diffs.append(f"unexpected columns {extra}")
    for name in (n for n in want if n in got):
        w, g = want[name], got[name]
        if not w.type.equals(g.type):
            diffs.append(f"column {name!r}: expected {w.type}, got {g.type}")
        elif g.nullable and not w.nullable:
            diffs.append(f"column {name!r}: expected non-nullable, got nullable")
    if not diffs and expected.names != actual.names:
        diffs.append(f"column order: expected {expected.names}, got {actual.names}")
    return diffs


def describe(expected: pa.Schema, actual: pa.Schema) -> str:
    """``differences`` in one line (``"nullability differs"`` when they are only that)."""
    return "; ".join(differences(expected, actual)) or "nullability differs"


# --------------------------------------------------------------------------- evolution


def check_evolution_option(owner: str, value: Any) -> SchemaEvolution:
    """``value`` as a ``schema_evolution`` option of ``owner``; ``ConfigError`` otherwise."""
    for known in EVOLUTIONS:
        if value == known:
            return known
    raise ConfigError(f"{owner} schema_evolution must be 'fail' or 'add_columns', "
                      f"got {value!r}")


def canonical(dtype: pa.DataType) -> pa.DataType:
    """The plain form of a type whose values a table stores alike: a dictionary's value
    type, ``string`` for large and view strings, ``binary`` for large and view binaries."""
    if pa.types.is_dictionary(dtype):
        return canonical(dtype.value_type)
    if pa.types.is_large_string(dtype) or pa.types.is_string_view(dtype):
        return pa.string()
    if pa.types.is_large_binary(dtype) or pa.types.is_binary_view(dtype):
        return pa.binary()
    return dtype


def lossless(old: pa.DataType, new: pa.DataType) -> bool:
    """Whether every value of ``old`` casts to ``new`` exactly (``new`` may be ``old``)."""
    a, b = canonical(old), canonical(new)
    if a.equals(b):
        return True
    t = pa.types
    if t.is_integer(a) and t.is_integer(b):
        if t.is_signed_integer(a) == t.is_signed_integer(b):
            return bool(b.bit_width >= a.bit_width)
        return bool(t.is_unsigned_integer(a) and b.bit_width > a.bit_width)
    if t.is_floating(a) and t.is_floating(b):
        return bool(b.bit_width >= a.bit_width)
    if t.is_decimal(a) and t.is_decimal(b):
        return bool(a.scale == b.scale and b.precision >= a.precision)
    return False


# wider types two integer types may both widen to (a signed and an unsigned one)
_COMMON_INTEGERS = (pa.int16(), pa.int32(), pa.int64())


def common_type(name: str, a: pa.DataType, b: pa.DataType) -> pa.DataType:
    """The narrowest type ``a`` and ``b`` both widen to without loss; a
    ``SchemaMismatchError`` naming the column when there is none."""
    if lossless(b, a):
        return a
    if lossless(a, b):
        return b
    for candidate in _COMMON_INTEGERS:
        if lossless(a, candidate) and lossless(b, candidate):
            return candidate
    raise SchemaMismatchError(
        f"column {name!r} is {a} in one part of the epoch and {b} in another, and no type "
        "holds both without loss; send it in one type (cast it) in every batch",
        column=name)


def union(schemas: Sequence[pa.Schema]) -> pa.Schema:
    """One schema holding every column of ``schemas`` (see the module docstring)."""
    fields: dict[str, pa.Field] = {}
    seen_in: dict[str, int] = {}
    for schema in schemas:
        for f in schema:
            known = fields.get(f.name)
            if known is None:
                fields[f.name] = f.remove_metadata()
                seen_in[f.name] = 1
                continue
            dtype = common_type(f.name, known.type, f.type)
            fields[f.name] = known.with_type(dtype).with_nullable(known.nullable or f.nullable)
            seen_in[f.name] += 1
    return pa.schema([f if seen_in[f.name] == len(schemas) else f.with_nullable(True)
                      for f in fields.values()])


def reported(manifests: Iterable[Mapping[str, object]]) -> list[pa.Schema]:
    """The schemas ``manifests`` report (each one's ``"schema"``, where it has one),
    decoded, in order."""
    return [decode(text) for m in manifests if isinstance(text := m.get("schema"), str)]


def united(manifests: Iterable[Mapping[str, object]], *, more: Iterable[pa.Schema] = (),
           where: Mapping[str, Any] | None = None) -> pa.Schema | None:
    """The ``union`` of the schemas ``manifests`` report and of ``more`` (say, of their
    files); ``None`` when no manifest reports one. A ``SchemaMismatchError`` names the
    column, and carries ``where`` (runtime, sink, epoch) when given."""
    schemas = reported(manifests)
    if not schemas:
        return None
    try:
        return union([*schemas, *more])
    except SchemaMismatchError as exc:
        if where is None:
            raise
        raise SchemaMismatchError(exc.message, column=exc.column, **where) from None


def loosen(schema: pa.Schema) -> pa.Schema:
    """``schema`` with every column nullable."""
    return pa.schema([f.with_nullable(True) for f in schema])


def _default_key(field: pa.Field) -> Hashable:
    key: Hashable = canonical(field.type)
    return key


def _never(old: pa.DataType, new: pa.DataType) -> bool:
    return False


@dataclass(frozen=True, kw_only=True, slots=True)
class Rules:
    """What one kind of target stores. ``target`` names it in messages ("the Delta
    table"); ``key`` maps a column to the target's own type (two columns with one key are
    stored alike); ``widen`` says whether the target can widen a column it holds from one
    Arrow type to a lossless wider one, and ``refuses_widening`` says why not, for the
    message."""

    target: str
    key: Callable[[pa.Field], Hashable] = _default_key
    widen: Callable[[pa.DataType, pa.DataType], bool] = _never
    refuses_widening: str = "the target cannot change a column's type"


@dataclass(frozen=True, slots=True)
class Evolution:
    """What a target becomes when it takes a schema: ``schema`` (its columns in order,
    widened where needed, then the added ones), and the columns ``added`` and
    ``widened``."""

    schema: pa.Schema
    added: tuple[str, ...] = ()
    widened: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.added or self.widened)


def evolve(current: pa.Schema, incoming: pa.Schema, rules: Rules, *,
           where: Mapping[str, Any] | None = None) -> Evolution:
    """What a target of schema ``current`` becomes when it takes ``incoming`` (see the
    module docstring); ``SchemaMismatchError`` naming the column it cannot take, with
    ``where`` (runtime, sink, epoch) in the error."""
    located = dict(where or {})
    fields = {f.name: f for f in current}
    added: list[str] = []
    widened: list[str] = []
    for inc in incoming:
        cur = fields.get(inc.name)
        if cur is None:
            fields[inc.name] = inc.remove_metadata().with_nullable(True)
            added.append(inc.name)
        elif _widens(cur, inc, rules, located):
            fields[inc.name] = cur.with_type(inc.type)
            widened.append(inc.name)
    for name, cur in fields.items():
        if name not in incoming.names and name not in added and not cur.nullable:
            raise SchemaMismatchError(
                f"column {name!r} is missing from the data and {rules.target} holds it as "
                "not nullable; send the column", column=name, **located)
    return Evolution(pa.schema(list(fields.values())), tuple(added), tuple(widened))


def refusal(current: pa.Schema, incoming: pa.Schema, rules: Rules, *,
            where: Mapping[str, Any] | None = None) -> SchemaMismatchError | None:
    """``schema_evolution="fail"``: ``None`` when ``incoming`` has ``current``'s columns
    (in any order), each stored alike (``rules.key``); else the error to raise, naming
    every column at fault (``column``: the first) and what to change."""
    have = {f.name: f for f in current}
    got = {f.name: f for f in incoming}
    problems = [(n, f"column {n!r} is missing from the data") for n in have if n not in got]
    problems += [(n, f"column {n!r} is not in {rules.target}") for n in got if n not in have]
    problems += [(n, f"column {n!r} is {_show(got[n], rules)} in the data and "
                     f"{_show(have[n], rules)} in {rules.target}")
                 for n in have if n in got and rules.key(have[n]) != rules.key(got[n])]
    if not problems:
        return None
    return SchemaMismatchError(
        f"the data does not fit {rules.target}: {'; '.join(text for _, text in problems)}; "
        "send the columns and types it holds (cast or drop the others), or give the sink "
        "schema_evolution='add_columns' to add new columns and widen types it can widen",
        column=problems[0][0], **dict(where or {}))


def _widens(cur: pa.Field, inc: pa.Field, rules: Rules, where: dict[str, Any]) -> bool:
    """False when ``inc`` is stored as ``cur`` is (alike, or narrower: cast up); True when
    the target's column widens to ``inc``'s type; otherwise a ``SchemaMismatchError``."""
    if rules.key(cur) == rules.key(inc):
        return False
    name, old, new = cur.name, cur.type, inc.type
    if not canonical(old).equals(canonical(new)):
        if lossless(new, old):
            return False
        if lossless(old, new):
            if rules.widen(old, new):
                return True
            raise SchemaMismatchError(
                f"column {name!r} is {_show(inc, rules)} in the data, wider than "
                f"{_show(cur, rules)} in {rules.target}: {rules.refuses_widening}; cast the "
                f"column to {old}", column=name, **where)
    raise SchemaMismatchError(
        f"column {name!r} is {_show(inc, rules)} in the data and {_show(cur, rules)} in "
        f"{rules.target}; that is not a lossless widening (only a wider integer, float or "
        "decimal precision is), so it is refused even with schema_evolution='add_columns'; "
        f"cast the column to {old}", column=name, **where)


def _show(field: pa.Field, rules: Rules) -> str:
    """A column's Arrow type, with the target's own name for it where that differs."""
    key = rules.key(field)
    return str(field.type) if isinstance(key, pa.DataType) else f"{field.type} ({key})"


def conformed(schema: pa.Schema, target: pa.Schema) -> pa.Schema:
    """``schema`` with each column the target holds in a wider type in that type (other
    columns, and columns the target lacks, as they are)."""
    fields = []
    for f in schema:
        index = target.get_field_index(f.name)
        want = target.field(index).type if index >= 0 else f.type
        if not canonical(want).equals(canonical(f.type)) and lossless(f.type, want):
            f = f.with_type(want)
        fields.append(f)
    return pa.schema(fields, metadata=schema.metadata)


def conform(data: _Data, target: pa.Schema) -> _Data:
    """``data`` (a batch or table) cast up to the target's wider types (``conformed``)."""
    schema = conformed(data.schema, target)
    return data if schema.equals(data.schema) else data.cast(schema)


def admit(batch: _Data, target: pa.Schema | None, so_far: pa.Schema | None, rules: Rules,
          *, where: Mapping[str, Any] | None = None) -> tuple[_Data, pa.Schema]:
    """A writer's ``add_columns`` step for one batch: ``SchemaMismatchError`` unless a
    target of schema ``target`` (``None``: no table yet) can take it (``evolve``); the
    batch cast up to the target's wider types; the union of ``so_far`` (the schema of the
    writer's batches until now) with it, without metadata."""
    if target is not None:
        evolve(target, batch.schema, rules, where=where)
        batch = conform(batch, target)
    schemas = [batch.schema] if so_far is None else [so_far, batch.schema]
    return batch, union(schemas).remove_metadata()


def align(tables: Sequence[pa.Table], target: pa.Schema) -> pa.Table:
    """``tables`` (each a subset of ``target``'s columns, in types ``target`` holds
    without loss) as one table of ``target``'s schema: its columns in its order, a column a
    table lacks null there, narrower types cast up."""
    parts = []
    for table in tables:
        columns = [table.column(f.name).cast(f.type) if f.name in table.column_names
                   else pa.nulls(table.num_rows, f.type) for f in target]
        parts.append(pa.Table.from_arrays(columns, schema=target))
    return pa.concat_tables(parts) if parts else target.empty_table()
