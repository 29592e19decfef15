"""The server contract (SPEC §8), shared by every server adapter: which requests are
covered, reading the ``Idempotency-Key``, the scope, the request fingerprint, which
responses are stored and with which headers, the stored-response record (the value the
store holds, readable by the adapters of every language) and the RFC 9457 problem
bodies. Every function is the Rust core's (``oncely::http``); the adapters
(:mod:`oncely.asgi`, :mod:`oncely.wsgi`) only call them.
"""

from __future__ import annotations

from ._oncely import (
    HTTP_DEFAULT_BODY_CAP as DEFAULT_BODY_CAP,
)
from ._oncely import (
    HTTP_DEFAULT_METHODS as DEFAULT_METHODS,
)
from ._oncely import (
    HTTP_DEFAULT_REQUEST_CAP as DEFAULT_REQUEST_CAP,
)
from ._oncely import (
    HTTP_DEFAULT_STORED_HEADERS as DEFAULT_STORED_HEADERS,
)
from ._oncely import (
    HTTP_DEFAULT_TENANT as DEFAULT_TENANT,
)
from ._oncely import (
    HTTP_GRPC_KEY_METADATA as GRPC_KEY_METADATA,
)
from ._oncely import (
    HTTP_KEY_HEADER as KEY_HEADER,
)
from ._oncely import (
    HTTP_PROBLEM_CONTENT_TYPE as PROBLEM_CONTENT_TYPE,
)
from ._oncely import (
    HTTP_REPLAYED_HEADER as REPLAYED_HEADER,
)
from ._oncely import (
    HTTP_REPLAYED_VALUE as REPLAYED_VALUE,
)
from ._oncely import (
    Problem,
    ServerConfig,
    declared_length,
    decode_response,
    encode_response,
    has_content,
    is_event_stream,
    is_grpc,
    is_json,
    request_fingerprint,
    storable_grpc_status,
    storable_status,
)
from ._oncely import (
    http_scope as scope,
)

__all__ = [
    "DEFAULT_BODY_CAP",
    "DEFAULT_METHODS",
    "DEFAULT_REQUEST_CAP",
    "DEFAULT_STORED_HEADERS",
    "DEFAULT_TENANT",
    "GRPC_KEY_METADATA",
    "KEY_HEADER",
    "PROBLEM_CONTENT_TYPE",
    "REPLAYED_HEADER",
    "REPLAYED_VALUE",
    "Problem",
    "ServerConfig",
    "declared_length",
    "decode_response",
    "encode_response",
    "has_content",
    "is_event_stream",
    "is_grpc",
    "is_json",
    "request_fingerprint",
    "scope",
    "storable_grpc_status",
    "storable_status",
]
