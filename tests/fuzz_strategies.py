"""Hypothesis strategies for fuzzing decoders: random bytes, mutated valid encodings, and
protobuf messages with fields set to hostile values.

A mutation takes a valid input and flips, overwrites, inserts, deletes, duplicates or
truncates bytes, or splices in an over-long varint, so most fuzzed inputs are *almost*
valid and get past the first checks of a decoder. ``hostile_message`` instead edits a
message field by field (lengths off by one, huge and negative numbers, NaN and infinities,
unknown enum values, unicode), descending into sub-messages and oneofs, and is then
byte-mutated now and then as well.

``fuzz(n)`` gives the settings of every fuzz test: derandomized (the same examples on
every run, so CI is deterministic) and without the example database.
"""

from __future__ import annotations

import json
from typing import Any

from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

_BASE = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def fuzz(max_examples: int) -> settings:
    """Settings of a fuzz test running ``max_examples`` examples (see the module doc)."""
    return settings(_BASE, max_examples=max_examples)


INT32 = (0, 1, -1, 2, 7, 63, 64, 1023, 1024, 2**31 - 1, -(2**31))
UINT32 = (0, 1, 2, 3, 7, 8, 15, 16, 63, 64, 1023, 1024, 65535, 2**31, 2**32 - 1)
INT64 = (*INT32, 2**32, 2**53 + 1, 2**62, 2**63 - 1, -(2**63))
UINT64 = (*UINT32, 2**32, 2**53 + 1, 2**63, 2**64 - 1)
FLOATS = (0.0, -0.0, 0.5, 1.0, -1.0, 1.0000001, 2.0, 1e-45, 3.4e38, 1e300)
NAN_INF = (float("nan"), float("inf"), float("-inf"))
TEXT = ("", "float32", "raw", "uint64", "x" * 300, "é", "😀", "\x00", "a/../b", "train")


def _ints(low: int, high: int, specials: tuple[int, ...]) -> st.SearchStrategy[int]:
    return st.sampled_from([v for v in specials if low <= v <= high]) | st.integers(low, high)


def _scalar(field: FD) -> st.SearchStrategy[Any]:
    t = field.type
    if t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        return _ints(-(2**31), 2**31 - 1, INT32)
    if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return _ints(-(2**63), 2**63 - 1, INT64)
    if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return _ints(0, 2**32 - 1, UINT32)
    if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return _ints(0, 2**64 - 1, UINT64)
    if t == FD.TYPE_FLOAT:
        return st.sampled_from(FLOATS + NAN_INF) | st.floats(width=32)
    if t == FD.TYPE_DOUBLE:
        return st.sampled_from(FLOATS + NAN_INF) | st.floats()
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t == FD.TYPE_ENUM:
        return _ints(-(2**31), 2**31 - 1, (0, 1, 2, 3, 99, -1))
    if t == FD.TYPE_STRING:
        return st.sampled_from(TEXT) | st.text(max_size=40)
    if t == FD.TYPE_BYTES:
        # Lengths around whole numbers of uint64 / float32 values, and odd ones.
        return st.sampled_from([b"", b"\x00", b"\xff" * 8, b"\x00" * 7, b"\x7f\xc0\x00\x00"]) | (
            st.binary(max_size=96)
        )
    raise AssertionError(f"unhandled field type {t}")


@st.composite
def hostile_message(draw: st.DrawFn, base: Message, depth: int = 0) -> Message:
    """A copy of ``base`` with one to three fields (or their sub-fields) set hostile."""
    msg = type(base)()
    msg.CopyFrom(base)
    fields = list(msg.DESCRIPTOR.fields)
    if not fields:
        return msg
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(fields))
        _mutate_field(draw, msg, field, depth)
    return msg


def _mutate_field(draw: st.DrawFn, msg: Message, field: FD, depth: int) -> None:
    name = field.name
    if field.type == FD.TYPE_MESSAGE:
        if depth >= 3:
            msg.ClearField(name)
            return
        if field.is_repeated:
            if field.message_type.GetOptions().map_entry:
                msg.ClearField(name)
                return
            container = getattr(msg, name)
            action = draw(st.sampled_from(["add", "clear", "mutate"]))
            if action == "clear" or (action == "mutate" and not len(container)):
                msg.ClearField(name)
            if action == "add" or not len(container):
                empty = GetMessageClass(field.message_type)()
                container.add().CopyFrom(draw(hostile_message(empty, depth + 1)))
            else:
                i = draw(st.integers(0, len(container) - 1))
                container[i].CopyFrom(draw(hostile_message(container[i], depth + 1)))
            return
        sub = getattr(msg, name)
        if draw(st.booleans()) and msg.HasField(name):
            msg.ClearField(name)
        else:
            sub.CopyFrom(draw(hostile_message(sub, depth + 1)))
            sub.SetInParent()  # selects the oneof case even when the copy is empty
        return
    values = _scalar(field)
    if field.is_repeated:
        shape = draw(st.sampled_from(["clear", "append", "replace", "long"]))
        container = getattr(msg, name)
        if shape == "clear":
            msg.ClearField(name)
        elif shape == "append":
            container.append(draw(values))
        elif shape == "replace":
            msg.ClearField(name)
            container.extend(draw(st.lists(values, max_size=8)))
        else:
            container.extend([draw(values)] * draw(st.sampled_from([100, 1000])))
        return
    setattr(msg, name, draw(values))


_VARINTS = [b"\xff" * 9 + b"\x01", b"\x80" * 10, b"\xff\xff\xff\xff\x0f", b"\x80\x80\x80\x80\x10"]


@st.composite
def mutated_bytes(draw: st.DrawFn, base: bytes, max_ops: int = 4) -> bytes:
    """``base`` with 1..max_ops byte-level mutations."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "dup", "varint"]))
        pos = draw(st.integers(0, len(data)))
        at = min(pos, len(data) - 1)
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[at] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x01]) | st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 16))]
        elif op == "truncate":
            del data[pos:]
        elif op == "dup" and data:
            end = min(len(data), at + draw(st.integers(1, 32)))
            data[pos:pos] = data[at:end]
        elif op == "varint":
            data[pos:pos] = draw(st.sampled_from(_VARINTS))
    return bytes(data)


def message_bytes(*seeds: Message) -> st.SearchStrategy[bytes]:
    """Serialized requests built from valid ``seeds``: mutated at field level, at byte level,
    both, or unchanged; and some random bytes."""

    def of(seed: Message) -> st.SearchStrategy[bytes]:
        raw = seed.SerializeToString()
        hostile = hostile_message(seed).map(lambda m: m.SerializeToString())
        return st.one_of(
            hostile,
            mutated_bytes(raw),
            hostile.flatmap(mutated_bytes),
            st.just(raw),
        )

    return st.one_of(*(of(s) for s in seeds), st.binary(max_size=64))


# --- JSON -------------------------------------------------------------------------------

_JSON_ODD = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-0",
    "9" * 5000,
    "1" + "0" * 400,
    '"\\ud800"',
    '"\\u0000"',
    "[" * 5000 + "]" * 5000,
    '{"a":' * 3000 + "1" + "}" * 3000,
    "true",
    "null",
    "[]",
    '""',
]


def json_values(max_leaves: int = 8) -> st.SearchStrategy[Any]:
    """Arbitrary JSON-able values: wrong types for any key of a spec."""
    leaf = (
        st.none()
        | st.booleans()
        | st.sampled_from(INT64 + (10**30, -(10**30)))
        | st.integers()
        | st.floats()
        | st.text(max_size=20)
    )
    return st.recursive(
        leaf,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
        max_leaves=max_leaves,
    )


@st.composite
def mutated_json_doc(draw: st.DrawFn, base: dict[str, Any]) -> str:
    """A JSON document from ``base``: keys set to wrong types, removed, added or nested,
    then maybe byte-mutated as text, or replaced by an odd literal (deep nesting, huge
    numbers, NaN, lone surrogates)."""
    doc = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(0, 3))):
        target = doc
        key = draw(st.sampled_from(sorted(_keys(doc))))
        if isinstance(target.get(key), dict) and draw(st.booleans()) and target[key]:
            target = target[key]
            key = draw(st.sampled_from(sorted(target)))
        action = draw(st.sampled_from(["wrong", "drop", "add", "odd"]))
        if action == "wrong":
            target[key] = draw(json_values())
        elif action == "drop":
            target.pop(key, None)
        elif action == "add":
            target[draw(st.text(max_size=10))] = draw(json_values())
        else:
            target[key] = _Raw(draw(st.sampled_from(_JSON_ODD)))
    text = _dumps(doc)
    how = draw(st.sampled_from(["as_is", "bytes", "odd"]))
    if how == "bytes":
        return draw(mutated_bytes(text.encode())).decode("utf-8", errors="replace")
    if how == "odd":
        return draw(st.sampled_from(_JSON_ODD))
    return text


def _keys(doc: dict[str, Any]) -> set[str]:
    return set(doc) or {"kind"}


class _Raw(str):
    """A JSON literal inserted verbatim (json.dumps cannot write deep nesting or NaN as text)."""


def _dumps(value: Any) -> str:
    if isinstance(value, _Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_dumps(v) for v in value) + "]"
    return json.dumps(value)
