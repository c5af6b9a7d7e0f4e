"""An image-only processor: tokenizer + the family's PIL image processor + chat template, no torchvision.

The stock processors (``Qwen3VLProcessor``, ``Glm4vProcessor``, ...) need a video processor, which needs
torchvision; mmkv does images only, so it drives the tokenizer and the family's PIL image processor directly,
doing what the stock processor does for images: render the chat template, then replace the ``i``-th image pad
(the family's ``tokens.pad``: ``<|image_pad|>``, ``<|image|>``) with ``grid_i.prod() // merge**2`` pads, then
tokenize. Token ids are therefore those the stock processor produces.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from .families import Family
from .families.base import size_bounds

__all__ = ["ImageInputs", "VLProcessor", "read_chat_template"]


@dataclass(frozen=True)
class ImageInputs:
    """What the vision tower takes for a batch of images."""

    pixel_values: torch.Tensor  # (sum of t*h*w patches, C * temporal_patch * patch * patch) float32
    image_grid_thw: torch.Tensor  # (num_images, 3) long: vision grid (1, h, w) per image


def read_chat_template(directory: Path) -> str | None:
    """The chat template saved in a checkpoint directory, or ``None``.

    Looks where transformers looks: ``chat_template.jinja``, then ``chat_template.json`` (key
    ``chat_template``); the tokenizer's own template is the caller's fallback.
    """
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    as_json = directory / "chat_template.json"
    if as_json.is_file():
        return json.loads(as_json.read_text(encoding="utf-8")).get("chat_template")
    return None


class VLProcessor:
    """Prompt rendering and image preprocessing for one checkpoint of ``family`` (stateless after
    construction)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, image_processor, chat_template: str, family: Family
    ) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.chat_template = chat_template
        self.family = family
        tokens = family.tokens
        vocab = tokenizer.get_vocab()
        missing = [t for t in (tokens.pad, tokens.start, tokens.end, family.end_of_turn) if t not in vocab]
        if missing:
            raise ValueError(f"the tokenizer lacks the {family.label} special tokens {missing}")
        self.image_pad: str = tokens.pad  # the template's image placeholder, expanded to one pad per token
        self.image_token_id: int = vocab[tokens.pad]  # <|image_pad|>, <|image|>
        self.vision_start_token_id: int = vocab[tokens.start]  # <|vision_start|>, <|begin_of_image|>
        self.vision_end_token_id: int = vocab[tokens.end]  # <|vision_end|>, <|end_of_image|>
        self.end_of_turn_id: int = vocab[family.end_of_turn]  # <|im_end|>, <|user|>: an answer ends there

    @property
    def merge_size(self) -> int:
        """Spatial merge of the vision tower: ``merge**2`` patches become one language-model token."""
        return int(self.image_processor.merge_size)

    @property
    def patch_size(self) -> int:
        """Vision patch side in pixels (14 for Qwen2/2.5-VL, 16 for Qwen3-VL)."""
        return int(self.image_processor.patch_size)

    @property
    def pixel_bounds(self) -> tuple[int, int]:
        """``(min_pixels, max_pixels)`` that the family's ``smart_resize`` keeps an image within (GLM counts
        an image as two frames)."""
        return size_bounds(self.image_processor)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The prompt text of a conversation, with one image pad per image item; ``tools`` (OpenAI
        function specs) are rendered as the template renders them (the system message lists them)."""
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            tools=tools or None,
        )

    def preprocess_images(self, images: Sequence[Image.Image]) -> ImageInputs:
        """Resize, normalise and patchify RGB images: ``ImageInputs`` for the vision tower."""
        out = self.image_processor(images=list(images), return_tensors="pt")
        return ImageInputs(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"].long())

    def image_grid(self, image: Image.Image) -> tuple[int, int, int]:
        """The vision grid ``(1, h, w)`` ``preprocess_images`` gives ``image``, from its size alone (no pixels
        are touched): the family's ``smart_resize`` to multiples of ``patch * merge`` within the bounds."""
        height, width = self.family.resize(self.image_processor, image.height, image.width)
        return 1, height // self.patch_size, width // self.patch_size

    def num_image_tokens(self, grid_thw: torch.Tensor | Sequence[int]) -> int:
        """Pads one image expands to: ``t * h * w // merge**2``."""
        t, h, w = (int(x) for x in (grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw))
        return t * h * w // self.merge_size**2

    def expand_image_pads(self, text: str, grids: torch.Tensor) -> str:
        """``text`` with its ``i``-th image pad repeated ``num_image_tokens(grids[i])`` times."""
        pieces = text.split(self.image_pad)
        if len(pieces) - 1 != len(grids):
            raise ValueError(
                f"the text has {len(pieces) - 1} image placeholders but {len(grids)} images were given"
            )
        out = [pieces[0]]
        for grid, piece in zip(grids, pieces[1:], strict=True):
            out.append(self.image_pad * self.num_image_tokens(grid))
            out.append(piece)
        return "".join(out)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added around it."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def __call__(self, text: str, images: Sequence[Image.Image] | None = None) -> dict[str, torch.Tensor]:
        """Model inputs for one prompt, as the stock processor returns them for images.

        Returns ``input_ids (1, L)``, ``attention_mask (1, L)``, ``mm_token_type_ids (1, L)`` (1 at image pads)
        and, with images, ``pixel_values`` and ``image_grid_thw (N, 3)``.
        """
        inputs: dict[str, torch.Tensor] = {}
        if images:
            image_inputs = self.preprocess_images(images)
            text = self.expand_image_pads(text, image_inputs.image_grid_thw)
            inputs["pixel_values"] = image_inputs.pixel_values
            inputs["image_grid_thw"] = image_inputs.image_grid_thw
        elif self.image_pad in text:
            raise ValueError("the text has image placeholders but no images were given")
        ids = torch.tensor([self.encode_text(text)], dtype=torch.long)  # (1, L)
        inputs["input_ids"] = ids
        inputs["attention_mask"] = torch.ones_like(ids)
        inputs["mm_token_type_ids"] = (ids == self.image_token_id).int()
        return inputs

    def save_pretrained(self, directory: str | Path) -> None:
        """Write tokenizer files, ``preprocessor_config.json`` and ``chat_template.jinja`` into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(directory)
        self.image_processor.save_pretrained(directory)
        (directory / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")

    @classmethod
    def from_pretrained(cls, directory: str | Path, family: Family) -> VLProcessor:
        """The processor of a ``family`` checkpoint, from its directory (tokenizer, ``preprocessor_config.json``,
        chat template)."""
        directory = Path(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        image_processor = family.image_processor_class().from_pretrained(directory)
        template = read_chat_template(directory) or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError(f"{directory} has no chat template (chat_template.jinja, chat_template.json)")
        return cls(tokenizer, image_processor, template, family)
