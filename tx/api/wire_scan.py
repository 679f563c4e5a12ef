"""Count a protobuf body's messages before parsing it: parsing builds an object per message, about 56 bytes
for an empty one that takes 2 bytes on the wire, so a body of empty datums or chunks swelled 28-fold (a
715-byte zstd body of 4 million empty datums parsed to 224 MB, a 64 MiB one would take 1.8 GB) before any
limit was checked. `check_forward_backward` walks the top level and each datum's fields, skipping every
byte string by its length, and stops at the first count past its limit, so the walk is as cheap as the
limits are small and a hostile body costs no more than a legitimate one.
"""

from __future__ import annotations

from collections.abc import Iterator

DATA = 3  # ForwardBackwardRequest.data (`tx.api.wire_proto`)
CONFIG_MAPS = (5, 7)  # loss_fn_config, loss_fn_config_v2: one message per entry
MAX_CONFIG_ENTRIES = 64


class ScanError(ValueError):
    """The body's message counts pass a limit."""


class MalformedBody(ScanError):
    """The body's wire format cannot be walked: it is no protobuf message."""


def check_forward_backward(body: bytes, max_datums: int, max_datum_entries: int) -> None:
    """Refuse a ForwardBackwardRequest body with more than `max_datums` datums, more than `max_datum_entries`
    entries (model_input chunks, loss_fn_inputs, provenance spans) over all its datums, or more than
    `MAX_CONFIG_ENTRIES` loss_fn_config entries, before it is parsed."""
    datums = entries = configs = 0
    for number, span in _fields(body, 0, len(body)):
        if number in CONFIG_MAPS:
            configs += 1
            if configs > MAX_CONFIG_ENTRIES:
                raise ScanError(f"loss_fn_config has more than {MAX_CONFIG_ENTRIES} entries, the limit")
        if number != DATA or span is None:
            continue
        datums += 1
        if datums > max_datums:
            raise ScanError(f"data has more than {max_datums} datums, the limit")
        for _ in _fields(body, *span):
            entries += 1
            if entries > max_datum_entries:
                raise ScanError(
                    f"the datums hold more than {max_datum_entries} entries (model_input chunks, loss_fn_inputs, "
                    "spans) together, the limit"
                )


def _fields(buf: bytes, start: int, end: int) -> Iterator[tuple[int, tuple[int, int] | None]]:
    """(field number, (start, end) of a length-delimited value, else None) of each field in buf[start:end]."""
    pos = start
    while pos < end:
        key = buf[pos]  # one-byte keys and lengths (fields 1-15, values under 128 bytes) read inline
        key, pos = (key, pos + 1) if key < 0x80 else _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(buf, pos, end)
            yield number, None
        elif wire == 2:
            length = buf[pos] if pos < end else 0x80
            length, pos = (length, pos + 1) if length < 0x80 else _varint(buf, pos, end)
            if length > end - pos:
                raise MalformedBody("a field runs past its end")
            yield number, (pos, pos + length)
            pos += length
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            yield number, None
        else:  # groups (3, 4) are never sent, and would hide the fields inside them from this count
            raise MalformedBody(f"wire type {wire} is not accepted")
    if pos > end:
        raise MalformedBody("a field runs past its end")


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise MalformedBody("a truncated or overlong varint")
