"""The request bodies of the SGLang 0.5.23 endpoints the fake serves, mirrored field by field.

Each class below has exactly the fields and defaults of the class of the same name in the
pinned wheel's ``sglang/srt/managers/io_struct.py`` (``BaseReq``'s ``rid`` and
``http_worker_ipc`` included); ``tests/sglang_schema`` checks them against a committed
snapshot and the snapshot against the wheel. Types are the JSON-level shape of SGLang's
(custom types that only matter to features the fake does not model are ``Any``).

How SGLang refuses a body, reproduced by :func:`decode_body` and
:func:`sampling_params_contract_error`:

- unknown top-level keys are *ignored* (FastAPI/pydantic parse the dataclass and the
  msgspec Structs with ``extra="ignore"``, ``utils/msgspec_utils.py``);
- a missing required field or a value of the wrong type is a validation error: HTTP 400
  with ``{"object": "error", "message": ..., "type": "Bad Request", "param": null,
  "code": 400}`` (``http_server.py`` ``validation_exception_handler``; the message text is
  pydantic's and differs here);
- for ``/generate`` only, the JSON contract gate (``api/v1/api_types.py``) then refuses
  *unknown keys inside* ``sampling_params`` (and type errors there): HTTP 400 with
  ``{"error": "unknown field `x`, expected one of `max_new_tokens`, ..."}``, same text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeAlias, TypeVar

import msgspec

__all__ = [
    "SAMPLING_PARAMS_DEFAULTS",
    "AbortReq",
    "BeginWeightUpdateReqInput",
    "CheckWeightsReqInput",
    "ContinueGenerationReqInput",
    "DestroyWeightsUpdateGroupReqInput",
    "EndWeightUpdateReqInput",
    "FlushCacheReqInput",
    "GenerateReqInput",
    "InitWeightsUpdateGroupReqInput",
    "PauseGenerationReqInput",
    "ReleaseMemoryOccupationReqInput",
    "ResumeMemoryOccupationReqInput",
    "UpdateWeightVersionReqInput",
    "UpdateWeightsFromDistributedReqInput",
    "decode_body",
    "generate_contract_error",
    "sampling_params_contract_error",
]

Selector = Literal["target", "draft", "all"]
Body = TypeVar("Body", bound=msgspec.Struct)


class _BaseReq(msgspec.Struct, kw_only=True):
    rid: str | None = None
    http_worker_ipc: str | None = None


class PauseGenerationReqInput(_BaseReq, kw_only=True):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(_BaseReq, kw_only=True):
    torch_empty_cache: bool = True


class AbortReq(_BaseReq, kw_only=True):
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None
    weight_versions: Any = None


class FlushCacheReqInput(_BaseReq, kw_only=True):
    timeout_s: float | None = None


class ReleaseMemoryOccupationReqInput(_BaseReq, kw_only=True):
    tags: list[str] | None = None


class ResumeMemoryOccupationReqInput(_BaseReq, kw_only=True):
    tags: list[str] | None = None


class InitWeightsUpdateGroupReqInput(_BaseReq, kw_only=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReqInput(_BaseReq, kw_only=True):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedReqInput(_BaseReq, kw_only=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Selector = "all"
    torch_empty_cache: bool = False


class UpdateWeightVersionReqInput(_BaseReq, kw_only=True):
    new_version: str
    abort_all_requests: bool = True


class BeginWeightUpdateReqInput(_BaseReq, kw_only=True):
    selector: Selector = "all"


class EndWeightUpdateReqInput(_BaseReq, kw_only=True):
    pass


class CheckWeightsReqInput(_BaseReq, kw_only=True):
    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list[str] | None = None
    selector: Selector = "all"


class GenerateReqInput(msgspec.Struct, kw_only=True):
    rid: str | list[str] | None = None
    session_id: str | None = None
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: bool = False
    video_config: dict[str, Any] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    watermark: Any = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[Any] | None = None
    return_sampling_mask: bool | list[bool] | None = None
    sampling_logprobs_mode: Any = None
    return_text_in_logprobs: bool = False
    return_flat_raw_top_logprobs: bool = False
    return_flat_raw_output_top_logprobs: bool = False
    return_flat_raw_top_logprobs_b64: bool = False
    stream: bool = False
    log_metrics: bool = True
    return_hidden_states: Any = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_indexer_topk: bool = False
    modalities: list[str] | None = None
    session_params: dict[str, Any] | None = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    positional_embed_overrides: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    http_worker_ipc: str | None = None
    background: bool = False
    require_reasoning: bool = False
    max_thinking_tokens: int | None = None
    priority: int | None = None
    extra_key: str | list[str] | None = None
    no_logs: bool = False
    custom_labels: dict[str, str] | None = None
    return_bytes: bool = False
    return_entropy: bool = False
    return_prompt_token_ids: bool = False
    external_trace_header: dict[str, Any] | None = None
    received_time: float | None = None
    need_wait_for_mm_inputs: bool | None = None
    num_items_assigned: Any = None
    encoder_urls: list[str] | None = None
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    image_max_dynamic_patch: int | None = None
    video_max_dynamic_patch: int | None = None
    images_config: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    multi_item_delimiter_indices: list[Any] | None = None
    token_indices_to_pool: list[Any] | None = None
    cache_salt: str | list[str] | None = None
    kv_hints: Any = None


SAMPLING_PARAMS_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128,
    "stop": None,
    "stop_token_ids": None,
    "stop_regex": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 1073741824,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "stream_interval": None,
    "logit_bias": {},
    "sampling_seed": None,
    "custom_params": None,
    "beam_width": None,
    "watermark": None,
    "choice": [],
}
"""``api/v1/api_types.py`` ``SamplingParams``: the keys ``/generate`` accepts in
``sampling_params``, in SGLang's order, with their defaults."""

_INT_KEYS = frozenset(
    {"max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval", "sampling_seed"}
    | {"beam_width"}
)
_FLOAT_KEYS = frozenset(
    {"temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty"}
    | {"repetition_penalty"}
)
_BOOL_KEYS = frozenset(
    {"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
)
_STR_KEYS = frozenset({"json_schema", "regex", "ebnf", "structural_tag"})


def _unexpected(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def _type_error(key: str, value: Any) -> str | None:
    if value is None or key not in _INT_KEYS | _FLOAT_KEYS | _BOOL_KEYS | _STR_KEYS:
        return None
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if key in _INT_KEYS and not is_int:
        return f"invalid type: {_unexpected(value)}, expected i64"
    if key in _FLOAT_KEYS and not (is_int or isinstance(value, float)):
        return f"invalid type: {_unexpected(value)}, expected f64"
    if key in _BOOL_KEYS and not isinstance(value, bool):
        return f"invalid type: {_unexpected(value)}, expected a boolean"
    if key in _STR_KEYS and not isinstance(value, str):
        return f"invalid type: {_unexpected(value)}, expected a string"
    return None


def _sampling_error(value: Any) -> str | None:
    if not isinstance(value, dict):
        return f"invalid type: {_unexpected(value)}, expected struct SamplingParams"
    for key, item in value.items():
        if key not in SAMPLING_PARAMS_DEFAULTS:
            listed = ", ".join(f"`{name}`" for name in SAMPLING_PARAMS_DEFAULTS)
            return f"unknown field `{key}`, expected one of {listed}"
        error = _type_error(key, item)
        if error is not None:
            return error
    return None


def sampling_params_contract_error(value: Any) -> str | None:
    """The contract gate's error text for a ``sampling_params`` value, or None if it passes.

    Mirrors ``decode_SamplingParamsOrList``: unknown keys are refused with serde's text,
    scalar keys are type-checked (the nested ``watermark``/``stop`` shapes are not).
    """
    if value is None:
        return None
    if isinstance(value, list):
        return next((e for e in map(_sampling_error, value) if e is not None), None)
    if not isinstance(value, dict):
        return _invalid(value, "a value or an array of values for SamplingParamsOrList")
    return _sampling_error(value)


def _invalid(value: Any, expected: str) -> str:
    return f"invalid type: {_unexpected(value)}, expected {expected}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_Check: TypeAlias = Callable[[Any], str | None]
_KINDS: dict[str, Callable[[Any], bool]] = {
    "int": _is_int,
    "str": lambda value: isinstance(value, str),
    "bool": lambda value: isinstance(value, bool),
}


def _scalar(kind: str, expected: str, nullable: bool = True) -> _Check:
    test = _KINDS[kind]

    def check(value: Any) -> str | None:
        if value is None and nullable:
            return None
        return None if test(value) else _invalid(value, expected)

    return check


def _or_list(kind: str, name: str, item: str) -> _Check:
    scalar, element = (
        _scalar(kind, f"a value or an array of values for {name}"),
        _scalar(kind, item),
    )

    def check(value: Any) -> str | None:
        if isinstance(value, list):
            errors = [element(item) for item in value]
            return next((error for error in errors if error is not None), None)
        return scalar(value)

    return check


def _token_ids(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, list):
        return _invalid(value, "a value or an array of values for TokenIdsOrList")
    flat = not value or (isinstance(value[0], int | float) and not isinstance(value[0], bool))
    for row in [value] if flat else value:
        if not isinstance(row, list):
            return _invalid(row, "a sequence")
        for token in row:
            if not _is_int(token):
                return _invalid(token, "i64")
    return None


def _unsigned(value: Any) -> str | None:
    if value is None:
        return None
    if not _is_int(value):
        return _invalid(value, "u64")
    return None if value >= 0 else f"invalid value: integer `{value}`, expected u64"


_GENERATE_CHECKS: dict[str, _Check] = {
    "rid": _or_list("str", "StringOrList", "a string"),
    "text": _or_list("str", "StringOrList", "a string"),
    "input_ids": _token_ids,
    "stream": _scalar("bool", "a boolean"),
    "sampling_params": sampling_params_contract_error,
    "return_logprob": _or_list("bool", "BoolOrList", "a boolean"),
    "logprob_start_len": _or_list("int", "Int64OrList", "i64"),
    "top_logprobs_num": _or_list("int", "Int64OrList", "i64"),
    "token_ids_logprob": _token_ids,
    "return_hidden_states": _or_list("bool", "BoolOrList", "a boolean"),
    "return_text_in_logprobs": _scalar("bool", "a boolean"),
    "routed_dp_rank": _scalar("int", "i64"),
    "disagg_prefill_dp_rank": _scalar("int", "i64"),
    "extra_key": _or_list("str", "StringOrList", "a string"),
    "priority": _scalar("int", "i64"),
    "cache_salt": _or_list("str", "StringOrList", "a string"),
    "require_reasoning": _scalar("bool", "a boolean"),
    "routing_key": _scalar("str", "a string"),
    "max_thinking_tokens": _unsigned,
    "session_id": _scalar("str", "a string"),
    "return_prompt_token_ids": _scalar("bool", "a boolean", nullable=False),
    "routed_experts_start_len": _scalar("int", "i64", nullable=False),
    "return_sampling_mask": _or_list("bool", "BoolOrList", "a boolean"),
}


def generate_contract_error(body: Any) -> str | None:
    """The ``/generate`` JSON contract gate (``api_contract.generate_contract_error``).

    Runs on the raw JSON after the lax body validation passed; checks keys in body order and
    reports the first violation with the generated decoder's text. Covers the keys dynarl
    and common clients send (scalars, token ids, ``sampling_params``); the media, LoRA,
    bootstrap and KV-hint shapes are not checked here.
    """
    if not isinstance(body, dict):
        return _invalid(body, "struct GenerateRequest")
    for key, value in body.items():
        check = _GENERATE_CHECKS.get(key)
        error = check(value) if check is not None else None
        if error is not None:
            return error
    return None


def decode_body(raw: bytes, kind: type[Body]) -> Body:
    """Decode a JSON request body the way SGLang's FastAPI routes do.

    Unknown keys are ignored; lax scalar coercion as pydantic's lax mode ("5" for an int).
    Raises ``ValueError`` with a pydantic-like message for a missing body, bad JSON, a
    missing required field or a wrong type.
    """
    if not raw.strip():
        raise ValueError(f"1 validation error for {kind.__name__}\nbody\n  Field required")
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ValueError(f"JSON decode error: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"1 validation error for {kind.__name__}\n  Input should be an object")
    try:
        return msgspec.convert(data, type=kind, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"1 validation error for {kind.__name__}\n  {exc}") from exc
