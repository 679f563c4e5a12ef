"""The Tinker protobuf schema (package `tinker_public`, proto3), built at import time.

There is no .proto file and no protoc step: the messages are described by the table below (field
numbers from the wire contract, §A) and turned into message classes with `descriptor_pb2` and
`message_factory` in a private descriptor pool, so they never collide with the SDK's own generated
module when both live in one process. Only field numbers and types matter on the wire; the
package name is kept for readability.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
    "bool": _F.TYPE_BOOL,
    "double": _F.TYPE_DOUBLE,
    "float": _F.TYPE_FLOAT,
    "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64,
    "uint32": _F.TYPE_UINT32,
    "uint64": _F.TYPE_UINT64,
}
_ENUMS = {
    "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"],
    "DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
}

# message -> [(field name, number, type, modifier)], modifier: "" | "repeated" | "oneof:<name>" | "map:<k>"
_MESSAGES: dict[str, list[tuple[str, int, str, str]]] = {
    "ForwardBackwardRequest": [
        ("model_id", 1, "string", ""),
        ("seq_id", 2, "int32", ""),
        ("data", 3, "Datum", "repeated"),
        ("loss_fn", 4, "string", ""),
        ("loss_fn_config", 5, "double", "map:string"),
        ("forward_only", 6, "bool", ""),
        ("loss_fn_config_v2", 7, "LossConfigValue", "map:string"),
    ],
    "LossConfigValue": [("number", 1, "double", "oneof:value"), ("text", 2, "string", "oneof:value")],
    "Datum": [
        ("model_input", 1, "Chunk", "repeated"),
        ("loss_fn_inputs", 2, "Tensor", "map:string"),
        ("model_input_spans", 3, "ProvenanceSpan", "repeated"),
        ("loss_fn_input_spans", 4, "ProvenanceSpan", "repeated"),
    ],
    "ProvenanceSpan": [
        ("prompt_tokens", 1, "PromptProvenanceSpan", "oneof:span"),
        ("sampled_tokens", 2, "SampledProvenanceSpan", "oneof:span"),
    ],
    "PromptProvenanceSpan": [("sequence_id", 1, "string", ""), ("offset", 2, "int64", ""), ("length", 3, "int64", "")],
    "SampledProvenanceSpan": [("sequence_id", 1, "string", ""), ("offset", 2, "int64", ""), ("length", 3, "int64", "")],
    "Chunk": [
        ("encoded_text", 1, "EncodedTextChunk", "oneof:chunk"),
        ("image", 2, "ImageChunk", "oneof:chunk"),
        ("dmel", 3, "DmelChunk", "oneof:chunk"),
    ],
    "EncodedTextChunk": [("tokens", 1, "bytes", "")],
    "ImageChunk": [
        ("data", 1, "bytes", ""),
        ("format", 2, "string", ""),
        ("expected_tokens", 3, "int32", ""),
        ("override_dimensions", 4, "ImageDimensions", ""),
    ],
    "ImageDimensions": [("width", 1, "uint32", ""), ("height", 2, "uint32", "")],
    "DmelChunk": [("dmel", 1, "bytes", "")],
    "Tensor": [
        ("dense", 1, "bytes", "oneof:encoding"),
        ("sparse_csr", 2, "SparseCsr", "oneof:encoding"),
        ("dtype", 3, "DType", ""),
        ("shape", 4, "int64", "repeated"),
    ],
    "SparseCsr": [("values", 1, "bytes", ""), ("crow_indices", 2, "bytes", ""), ("col_indices", 3, "bytes", "")],
    "ForwardBackwardOutput": [
        ("loss_fn_output_type", 1, "string", ""),
        ("loss_fn_outputs", 2, "ArrayRecord", "repeated"),
        ("metrics", 3, "double", "map:string"),
    ],
    "ArrayRecord": [
        ("type_tag", 1, "string", ""),
        ("fields", 2, "BatchedTensor", "map:string"),
        ("num_datums", 3, "int64", ""),
    ],
    "BatchedTensor": [
        ("data", 1, "bytes", ""),
        ("offsets", 2, "bytes", ""),
        ("dtype", 3, "DType", ""),
        ("trailing_shape", 4, "int64", "repeated"),
    ],
    "SampleResponse": [
        ("sequences", 1, "SampledSequence", "repeated"),
        ("prompt_logprobs", 2, "bytes", ""),
        ("topk_prompt_logprobs", 3, "TopkLogprobs", ""),
        ("prompt_cache_hit_tokens", 4, "int32", ""),
        ("target_prompt_logprobs", 5, "Tensor", ""),
        ("prompt_alt_tokens", 6, "PromptAltTokens", ""),
    ],
    "PromptAltTokens": [("tokens", 1, "Tensor", ""), ("logprobs", 2, "Tensor", "")],
    "SampledSequence": [
        ("stop_reason", 1, "StopReason", ""),
        ("tokens", 2, "bytes", ""),
        ("logprobs", 3, "bytes", ""),
        ("topk_sampled_logprobs", 4, "TopkLogprobs", ""),
    ],
    "TopkLogprobs": [
        ("token_ids", 1, "bytes", ""),
        ("logprobs", 2, "bytes", ""),
        ("k", 3, "uint32", ""),
        ("length", 4, "uint32", ""),
    ],
}

PACKAGE = "tinker_public"


def _set_type(field: Any, type_name: str) -> None:
    if type_name in _SCALARS:
        field.type = _SCALARS[type_name]
    else:
        field.type = _F.TYPE_ENUM if type_name in _ENUMS else _F.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{type_name}"


def _add_map_entry(message: Any, field_name: str, key_type: str, value_type: str) -> str:
    entry = message.nested_type.add()
    entry.name = "".join(part.capitalize() for part in field_name.split("_")) + "Entry"
    entry.options.map_entry = True
    for name, number, type_name in (("key", 1, key_type), ("value", 2, value_type)):
        field = entry.field.add(name=name, number=number, label=_F.LABEL_OPTIONAL)
        _set_type(field, type_name)
    return f".{PACKAGE}.{message.name}.{entry.name}"


def _add_message(file_proto: Any, name: str, fields: list[tuple[str, int, str, str]]) -> None:
    message = file_proto.message_type.add(name=name)
    oneofs: list[str] = []
    for field_name, number, type_name, modifier in fields:
        field = message.field.add(name=field_name, number=number, label=_F.LABEL_OPTIONAL)
        if modifier.startswith("map:"):
            field.label, field.type = _F.LABEL_REPEATED, _F.TYPE_MESSAGE
            field.type_name = _add_map_entry(message, field_name, modifier[4:], type_name)
            continue
        _set_type(field, type_name)
        if modifier == "repeated":
            field.label = _F.LABEL_REPEATED
        elif modifier.startswith("oneof:"):
            if modifier[6:] not in oneofs:
                oneofs.append(modifier[6:])
                message.oneof_decl.add(name=modifier[6:])
            field.oneof_index = oneofs.index(modifier[6:])


def _build() -> dict[str, Any]:
    file_proto = descriptor_pb2.FileDescriptorProto(
        name="smolgym_tinker_public.proto", package=PACKAGE, syntax="proto3"
    )
    for enum_name, values in _ENUMS.items():
        enum = file_proto.enum_type.add(name=enum_name)
        for number, value_name in enumerate(values):
            enum.value.add(name=value_name, number=number)
    for name, fields in _MESSAGES.items():
        _add_message(file_proto, name, fields)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_proto)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}")) for name in _MESSAGES
    }


MESSAGES = _build()
ForwardBackwardRequest = MESSAGES["ForwardBackwardRequest"]
ForwardBackwardOutput = MESSAGES["ForwardBackwardOutput"]
SampleResponse = MESSAGES["SampleResponse"]

DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = 1, 2, 3, 4
STOP_REASON_STOP, STOP_REASON_LENGTH = 0, 1
