"""What every contract type stands on: the API group and version, the name rules and limits that both the
validators and the CRD schemas enforce, the enums (framework, tier, dtype, precision), `Model` (the pydantic
base: camelCase on the wire, unknown fields refused, frozen) and the small validators the field types share.
The other modules of the contract all build on these, so they sit at the bottom and import nothing of them.
"""

from __future__ import annotations

import enum
import json
import re
import unicodedata
from typing import Annotated, Any

import pydantic
from pydantic import alias_generators

GROUP = "volga.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Kubernetes names (DNS-1123 subdomains). ModelSpec names are also label values on their EMIs, so they keep to
# a label value's 63 characters; model ids name files and URLs on the nodes, and keep to the same rule.
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_MODEL_ID = re.compile(_DNS_SUBDOMAIN)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 63
NAME_RULE = (f"must be 1-{MAX_NAME} lowercase letters, digits, '-' or '.', starting and ending with a letter or "
             "digit (a DNS-1123 subdomain, as Kubernetes names are; not a path)")
# The largest dimension a spec may write: a tensor dimension is a 32-bit signed size in every runtime Volga serves.
MAX_DIM = 2**31 - 1
# Pool floors above this are a typo more often than a plan (and each floor is a process on some node).
MAX_FLOOR = 64
# Models a chain lists after its head.
MAX_CHAIN = 16
# Control characters (NUL included) and the bidirectional marks and overrides that make a name display as
# another: a tensor name is printed in errors, logs and metrics, and must read as what it is.
_BIDI = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
_TENSOR_NAME_PATTERN = r"^[^\x00-\x1f\x7f-\x9f\x{061C}\x{200E}\x{200F}\x{202A}-\x{202E}\x{2066}-\x{2069}]*$"


class Framework(enum.StrEnum):
    ONNX = "onnx"
    TORCHSCRIPT = "torchscript"
    PYTORCH = "pytorch"
    SERVER = "server"  # a model server the ModelSpec's `server` runs (`servers`)


class Tier(enum.StrEnum):
    """Where an instance lives, from fastest to wake to slowest."""

    HOT = "HOT"
    WARM = "WARM"
    SUSPENDED = "SUSPENDED"
    FROZEN = "FROZEN"
    COLD = "COLD"


class DType(enum.StrEnum):
    """Tensor element types, named as the Open Inference Protocol names them."""

    BOOL = "BOOL"
    UINT8 = "UINT8"
    UINT16 = "UINT16"
    UINT32 = "UINT32"
    UINT64 = "UINT64"
    INT8 = "INT8"
    INT16 = "INT16"
    INT32 = "INT32"
    INT64 = "INT64"
    FP16 = "FP16"
    FP32 = "FP32"
    FP64 = "FP64"


class Precision(enum.StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"


class Model(pydantic.BaseModel):
    """Base: camelCase on the wire, unknown fields rejected (a typo must not pass silently)."""

    model_config = pydantic.ConfigDict(
        alias_generator=alias_generators.to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_enum_values=False,
    )

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json", exclude_none=True)


def _show(value: Any) -> str:
    """A value as YAML spells it (true, null), for messages about what was written."""
    return json.dumps(value) if isinstance(value, bool | None | int | float) else repr(value)


def _dim(value: Any) -> Any:
    # Before pydantic's int: it would read `true` as 1 and say nothing useful about `null`.
    if isinstance(value, bool):
        raise ValueError(f"{_show(value)} is a boolean, not a size: write a positive integer, or -1 for any size")
    if value is None or isinstance(value, str):
        raise ValueError(f"{_show(value)} is not a size: write -1 for a dimension of any size (what a model "
                         "calls a symbolic dimension, such as 'batch'), or a positive integer")
    if not isinstance(value, int):
        raise ValueError(f"{_show(value)} is not a size: write a positive integer, or -1 for any size")
    return value


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"{_show(value)} is a boolean: write a number")
    return value


Dim = Annotated[int, pydantic.BeforeValidator(_dim)]
Count = Annotated[int, pydantic.BeforeValidator(_no_bool)]


def is_name(value: str) -> bool:
    """Whether `value` keeps to NAME_RULE (a ModelSpec's name, a model id)."""
    return len(value) <= MAX_NAME and _MODEL_ID.match(value) is not None


def _check_name(value: str) -> str:
    if not is_name(value):
        raise ValueError(NAME_RULE)
    return value


Name = Annotated[str, pydantic.AfterValidator(_check_name)]  # a ModelSpec's name or a model id (NAME_RULE)


def bad_characters(text: str) -> list[str]:
    """The control and bidirectional-override characters in `text`, each written as its code point (U+202E)."""
    return [f"U+{ord(c):04X}" for c in text if unicodedata.category(c) == "Cc" or c in _BIDI]
