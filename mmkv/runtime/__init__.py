"""The turn runtime under ``Session`` (and the server): a live cache, a planner, the stores of a turn, an
executor and a decoder, each owning its own state.

A turn flows: ``lay_out`` (``mmkv.prompt``) -> ``LiveCache.matching_prefix`` -> ``LiveCache.truncate`` ->
``plan_turn`` (asks ``TurnStores``) -> ``repair_plan`` (the budget beyond the seam) -> ``execute`` (one forward
call) -> ``TurnStores.flush`` (store writes, after the first token) -> ``Decoder`` (decode).
"""

from ..policy import DEFAULT_BUDGET, REPAIRS, RepairKind, ReusePolicy, TurnPolicy
from .answer_text import AnswerText
from .decode import DecodeOptions, Decoder, DecodeStep, vision_token_ids
from .execute import attention_mask, drain, execute, execute_steps, replace_span, resolve_features
from .grammar import TokenConstraint
from .live import LiveCache
from .patch import PatchStore, SegmentPatch, fit_patch
from .plan import (
    FeatureSlice,
    ImageReuse,
    KVOrigin,
    Plan,
    Splice,
    StoreWrite,
    pad_features,
    plan_replace,
    plan_turn,
)
from .repair import repair_plan
from .report import Answer, FinishReason, PrefillStats, RepairStats, TokenLogprob
from .sampling import GREEDY, LogitRules, Sampling
from .stores import TurnStores, inputs_nbytes, prepare_image, preprocess
from .turn import check_positions, run_turn, turn_steps

__all__ = [
    "DEFAULT_BUDGET",
    "GREEDY",
    "REPAIRS",
    "RepairKind",
    "RepairStats",
    "PatchStore",
    "SegmentPatch",
    "fit_patch",
    "repair_plan",
    "AnswerText",
    "DecodeOptions",
    "DecodeStep",
    "Decoder",
    "FinishReason",
    "LogitRules",
    "TokenConstraint",
    "TokenLogprob",
    "Answer",
    "PrefillStats",
    "FeatureSlice",
    "ImageReuse",
    "LiveCache",
    "Plan",
    "ReusePolicy",
    "Sampling",
    "KVOrigin",
    "Splice",
    "StoreWrite",
    "TurnPolicy",
    "TurnStores",
    "attention_mask",
    "check_positions",
    "drain",
    "execute",
    "execute_steps",
    "inputs_nbytes",
    "pad_features",
    "plan_replace",
    "plan_turn",
    "prepare_image",
    "preprocess",
    "replace_span",
    "resolve_features",
    "run_turn",
    "turn_steps",
    "vision_token_ids",
]
