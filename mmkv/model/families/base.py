"""``Family``: everything mmkv knows about one architecture family, in one record the rest of mmkv asks.

A family module (``qwen_vl.py``, ``glm4v.py``) defines one ``Family`` per behaviour (a dense model and its MoE
sibling share one when they cache alike) and nothing else needs to know its name: the rotary layout and the
position rule of its language model, how its vision outputs split per image and join back (DeepStack), the tokens
that mark an image and end an answer, its tool-call format, the chat template of the checkpoints mmkv builds
itself, its tiny test model and its released-size reference configs, and the names ``mmkv.load`` takes for its
released checkpoints.

Importing a family module loads neither torch nor transformers (the registry lists names before torch loads);
the builders and the ``rotary_layout`` / ``model_class`` methods import them when called. Worked example::

    family = FAMILIES["qwen3_vl_moe"]          # the Qwen3-VL family (dense and MoE share one record)
    family.model_class("qwen3_vl_moe")         # -> transformers.Qwen3VLMoeForConditionalGeneration
    family.tokens.pad                          # '<|image_pad|>'
    family.rotary_layout(model)                # RotaryLayout('interleaved', (24, 20, 20), pairing='half')
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from ...mrope import LayoutKind, Pairing, PositionRule, RotaryLayout

__all__ = ["Family", "ToolFormat", "VisionTokens", "size_bounds"]

ToolFormat = Literal["hermes"]  # tool-call formats mmkv parses and constrains (``mmkv.toolcalls``)


def size_bounds(image_processor) -> tuple[int, int]:
    """``(shortest_edge, longest_edge)`` of an image processor's ``size`` (a dict or a ``SizeDict``): the pixel
    bounds its ``smart_resize`` keeps an image within."""
    size = image_processor.size
    get = size.get if isinstance(size, dict) else (lambda k: getattr(size, k))
    return int(get("shortest_edge")), int(get("longest_edge"))


@dataclass(frozen=True, slots=True)
class VisionTokens:
    """The tokens a chat template writes for an image: ``start`` + one ``pad`` per language-model token +
    ``end`` (``start``/``end`` are ordinary text tokens to the position rule); ``video`` marks videos (never
    in an answer: mmkv does still images only)."""

    start: str  # e.g. "<|vision_start|>", "<|begin_of_image|>"
    pad: str  # e.g. "<|image_pad|>", "<|image|>"
    end: str  # e.g. "<|vision_end|>", "<|end_of_image|>"
    video: tuple[str, ...] = ()  # video markers and pads the tokenizer may hold

    def __post_init__(self) -> None:
        names = (self.start, self.pad, self.end, *self.video)
        if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
            raise ValueError(f"vision tokens must be distinct non-empty strings, got {names}")

    @property
    def all(self) -> tuple[str, ...]:
        """Every vision token: none may appear in an answer (it would have no image behind it)."""
        return (self.start, self.end, self.pad, *self.video)


@dataclass(frozen=True, eq=False)
class Family:
    """How mmkv treats one architecture family. Immutable; compared by identity (one record per family)."""

    name: str  # the family's key: the config ``model_type`` of its first model, e.g. "qwen3_vl"
    label: str  # for people: "Qwen3-VL"
    model_classes: Mapping[str, str]  # config model_type -> transformers class that loads it
    rotary_kind: LayoutKind  # which axis drives each frequency: "sectioned" | "interleaved"
    default_section: tuple[int, int, int]  # the model code's mrope_section when a config has none
    tokens: VisionTokens  # image markers and pad
    end_of_turn: str  # the token that ends an assistant answer (decoding stops there)
    special_tokens: tuple[
        str, ...
    ]  # the released tokenizer's added tokens, in order (tiny tokenizers use them)
    chat_template: (
        str  # the template of checkpoints mmkv builds (tiny, reference, small); real ones bring theirs
    )
    image_processor: str  # "module:Class" of the transformers PIL image processor
    resize: Callable[[Any, int, int], tuple[int, int]]  # (image processor, height, width) -> resized (h, w)
    config_token_ids: Callable[[PreTrainedTokenizerBase], dict[str, int]]  # config fields naming its tokens
    rotary_pairing: Pairing = "half"  # which channels one frequency turns: "half" | "adjacent"
    has_deepstack: bool = False  # vision features injected after the first LM layers (Qwen3-VL)
    tool_format: ToolFormat | None = "hermes"  # None: requests with tools are refused, clearly
    aliases: Mapping[str, str] = field(default_factory=dict)  # mmkv.load name -> hub id of a released model
    tiny_name: str | None = None  # the mmkv.load name of its tiny random-weight model
    build_tiny: Callable[[PreTrainedTokenizerBase], tuple[PreTrainedModel, Any]] | None = (
        None  # model, image proc.
    )
    # released-size configs: arch -> () -> (config, image processor with the hub's settings)
    references: Mapping[str, Callable[[], tuple[PretrainedConfig, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model_classes or self.name not in self.model_classes:
            raise ValueError(f"family {self.name!r} must map its own model_type to a class")
        if self.end_of_turn not in self.special_tokens:
            raise ValueError(f"family {self.name!r}: end of turn {self.end_of_turn!r} is not a special token")
        missing = [t for t in self.tokens.all if t not in self.special_tokens]
        if missing:
            raise ValueError(f"family {self.name!r}: vision tokens {missing} are not special tokens")

    def __repr__(self) -> str:
        return f"Family({self.name!r})"

    def model_class(self, model_type: str) -> type[PreTrainedModel]:
        """The transformers class of ``model_type`` (one of ``model_classes``). Imports transformers."""
        import transformers

        return getattr(transformers, self.model_classes[model_type])

    def image_processor_class(self) -> type:
        """The PIL image processor class the family's checkpoints use. Imports transformers."""
        import importlib

        module, name = self.image_processor.split(":")
        return getattr(importlib.import_module(module), name)

    def rotary_layout(self, model: PreTrainedModel) -> RotaryLayout:
        """The rotary layout of ``model``'s language side, read off the model itself: its config's section,
        its rotary embedding's ``inv_freq`` buffer (any ``rope_type``), its attention's channels per head.
        Does not change the model."""
        from ...mrope import rotary_layout_from_config

        language_model = model.model.language_model
        attention = language_model.layers[0].self_attn
        return rotary_layout_from_config(
            model.config.get_text_config(),
            self.rotary_kind,
            inv_freq=language_model.rotary_emb.inv_freq,
            pairing=self.rotary_pairing,
            head_dim=int(attention.head_dim),
            default_section=self.default_section,
        )

    def position_rule(self, merge_size: int) -> PositionRule:
        """The M-RoPE position rule for still images (every family here: ``PositionRule``; a family whose
        images advance positions otherwise overrides this)."""
        from ...mrope import PositionRule

        return PositionRule(merge_size)
