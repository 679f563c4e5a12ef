"""Per-request size limits, derived once from the served model and the server's settings.

Every bound that keeps a request's memory small lives here, so that the body reader, the wire
decoder and the validator agree: the bytes a body may have on the wire and after zstd, the datums
and tokens of one forward_backward, the top-K width of soft targets, the elements of one tensor, and
the stop list of a sample. The SDK learns the chunk size from `/client/config`
(`fwdbwd_max_chunk_bytes_count`), so its requests stay well inside `max_body_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tx.protocol import ModelInfo

MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    max_seq_len: int  # tokens of one datum, or prompt + max_tokens of one sample
    vocab_size: int
    max_datums: int = 1024  # per forward_backward request (the SDK's own chunk length)
    max_targets: int = 64  # K of top-K cross_entropy targets [N, K]
    max_stop: int = 32  # stop strings or stop token ids of one sample request
    max_stop_chars: int = 256  # characters of one stop string

    @property
    def max_request_tokens(self) -> int:
        """Tokens of all datums of one request."""
        return max(self.max_seq_len, min(self.max_datums * self.max_seq_len, 1 << 19))

    @property
    def max_datum_entries(self) -> int:
        """model_input chunks, loss_fn_inputs and provenance spans of all datums of one request together
        (`tx.api.wire_scan`): a chunk per token (the SDK's `ModelInput.append_int` makes one-token chunks) and
        16 more a datum. Each costs a Python object of about 100 bytes when parsed (54 MB at 540k); walking
        them on the wire takes about 0.1 s."""
        return self.max_request_tokens + 16 * self.max_datums

    @property
    def max_json_containers(self) -> int:
        """`{` and `[` of a JSON body (`tx.api.body_limit`): two a token (a one-token chunk of a legacy
        forward_backward or of a sample's prompt, `{"tokens": [5], ...}`) and 64 more a datum; about 64 bytes
        each when parsed (70 MB at 1.1M)."""
        return 2 * self.max_request_tokens + 64 * self.max_datums

    @property
    def max_tensor_elements(self) -> int:
        """Elements of one loss input: [N, K] at the longest datum and widest K."""
        return self.max_seq_len * min(self.max_targets, self.vocab_size)

    @property
    def max_body_bytes(self) -> int:
        """Bytes of a body on the wire and after decompression: room for the longest top-K datum (ids,
        int64 targets, float32 weights) and at least 8 MiB, at most 64 MiB."""
        longest_datum = self.max_seq_len * (4 + 12 * self.max_targets + 16)
        return min(max(8 * MiB, 2 * longest_datum), 64 * MiB)

    @property
    def sdk_chunk_bytes(self) -> int:
        """What the SDK is told to put in one forward_backward request (its estimate, before zstd)."""
        return min(5_000_000, self.max_body_bytes // 2)


def limits_for(info: ModelInfo) -> Limits:
    return Limits(max_seq_len=info.max_seq_len, vocab_size=info.vocab_size)
