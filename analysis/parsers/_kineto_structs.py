"""The msgspec side of the Kineto parser (analysis/parsers/kineto.py): typed and loose structs, the
batch decoders, and the slow path's conversion of json-decoded values. Imported by kineto when first
needed (the C fast path reads well-formed traces without it; msgspec's import is a fifth of a small
trace's time).
"""
from __future__ import annotations

from typing import Any

import msgspec

# Two decodings of the same events. A batch is first decoded into the typed structs, where msgspec
# checks in C that every field has the type Kineto writes, so the collector's loop needs no type
# checks or conversions. A batch where some event breaks the types (a string stream, a null name, a
# number out of range) is decoded again into the loose structs, whose events the collector checks
# and converts one by one. gc=False: the structs hold only decoded JSON values, which cannot form
# cycles, and untracked objects spare the cyclic collector.

class Args(msgspec.Struct, frozen=True, gc=False):
    """The event args this parser reads; Input Dims / Input type stay raw JSON until a collective
    needs them (every cpu_op of a record_shapes trace has them)."""

    stream: int | None = None
    correlation: int | None = None
    name: Any = None  # metadata events: the thread or process name
    collective_name: Any = msgspec.field(name="Collective name", default=None)
    in_nelems: Any = msgspec.field(name="In msg nelems", default=None)
    out_nelems: Any = msgspec.field(name="Out msg nelems", default=None)
    in_size: Any = msgspec.field(name="In msg size", default=None)
    out_size: Any = msgspec.field(name="Out msg size", default=None)
    dtype: Any = None
    group_size: Any = msgspec.field(name="Group size", default=None)
    pg_name: Any = msgspec.field(name="Process Group Name", default=None)
    pg_ranks: Any = msgspec.field(name="Process Group Ranks", default=None)
    seq: Any = msgspec.field(name="Seq", default=None)
    input_dims: msgspec.Raw = msgspec.field(name="Input Dims", default=msgspec.Raw())
    input_types: msgspec.Raw = msgspec.field(name="Input type", default=msgspec.Raw())


EMPTY_ARGS = Args()


class Event(msgspec.Struct, gc=False):
    ph: str | None = None
    cat: str | None = None
    name: str = ""
    pid: int | str | None = None
    tid: int | str | None = None
    ts: int | float | None = None
    dur: int | float | None = None
    args: Args = EMPTY_ARGS  # shared, never modified


# Args with any JSON value in stream and correlation: the same fields, names and defaults.
LooseArgs = msgspec.defstruct(
    "LooseArgs",
    [(f.name, Any if f.name in ("stream", "correlation") else f.type,
      msgspec.field(name=f.encode_name, default=f.default)) for f in msgspec.structs.fields(Args)],
    gc=False, module=__name__)


class LooseEvent(msgspec.Struct, gc=False):
    ph: Any = None
    cat: Any = None
    name: Any = None
    pid: Any = None
    tid: Any = None
    ts: Any = None
    dur: Any = None
    args: LooseArgs | None = None


BATCH = msgspec.json.Decoder(list[Event])
EVENT = msgspec.json.Decoder(Event)
STR = msgspec.json.Decoder(str)
LOOSE_BATCH = msgspec.json.Decoder(list[LooseEvent])
ARG_FIELDS = {f.name: f.encode_name for f in msgspec.structs.fields(Args)}
NOT_AN_EVENT = object()


def event_from_dict(value: Any) -> Any:
    """The slow path's decoded JSON value as a LooseEvent (or a marker when it is not an object)."""
    if not isinstance(value, dict):
        return NOT_AN_EVENT
    raw = value.get("args")
    args = None
    if isinstance(raw, dict):
        fields = {}
        for attr, key in ARG_FIELDS.items():
            if key in raw:
                v = raw[key]
                if attr in ("input_dims", "input_types"):
                    try:
                        v = msgspec.Raw(msgspec.json.encode(v))
                    except (msgspec.EncodeError, TypeError, ValueError, OverflowError):
                        continue
                fields[attr] = v
        args = LooseArgs(**fields)
    return LooseEvent(ph=value.get("ph"), cat=value.get("cat"), name=value.get("name"), pid=value.get("pid"),
                       tid=value.get("tid"), ts=value.get("ts"), dur=value.get("dur"), args=args)
