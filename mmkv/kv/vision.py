"""Vision-tower outputs per image: what the ``encoder`` reuse mode caches, in a version-neutral record.

``encode_images`` runs the model's own ``get_image_features`` and splits its output into one ``ImageFeatures``
per image: the merged embeddings that replace the image's pads and, for Qwen3-VL, the DeepStack features
injected after the first LM layers. They do not depend on the prompt, so reusing them is exact.
``join_features`` turns a list of them back into the object the model's forward expects, whose layout differs
across transformers versions (see ``mmkv.compat``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..compat import deepstack_split_per_image
from ..model.handle import ModelHandle
from ..model.processor import ImageInputs

__all__ = ["ImageFeatures", "encode_images", "join_features"]


@dataclass(frozen=True, eq=False)
class ImageFeatures:
    """The vision tower's output for one image."""

    embeds: torch.Tensor  # (pads, lm_hidden): replaces the image's pad embeddings
    deepstack: tuple[torch.Tensor, ...]  # per DeepStack layer (pads, lm_hidden); empty for Qwen2/2.5-VL

    @property
    def num_pads(self) -> int:
        """Pad tokens these features fill."""
        return int(self.embeds.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(t.numel() * t.element_size() for t in (self.embeds, *self.deepstack))


@torch.inference_mode()
def encode_images(handle: ModelHandle, images: ImageInputs) -> list[ImageFeatures]:
    """Run the vision tower on ``images``: one ``ImageFeatures`` per image, in order."""
    out = handle.model.model.get_image_features(
        images.pixel_values.to(handle.device, handle.dtype),
        images.image_grid_thw.to(handle.device),
        return_dict=True,
    )
    sizes = [handle.position_rule.num_image_tokens(g) for g in images.image_grid_thw]
    embeds = list(out.pooler_output)
    per_layer: list[Sequence[torch.Tensor]] = []
    for layer in getattr(out, "deepstack_features", None) or []:
        # transformers >= 5.24 splits per image; 5.17 returns one tensor over all images
        per_layer.append(torch.split(layer, sizes) if isinstance(layer, torch.Tensor) else layer)
    return [
        ImageFeatures(embeds=embeds[i], deepstack=tuple(layer[i] for layer in per_layer))
        for i in range(len(sizes))
    ]


def join_features(handle: ModelHandle, features: Sequence[ImageFeatures]):
    """The ``get_image_features``-style output the model's forward reads, for ``features`` in order."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    out = BaseModelOutputWithPooling(pooler_output=tuple(f.embeds for f in features))
    if handle.family.has_deepstack:
        num_layers = len(features[0].deepstack)
        per_layer = [tuple(f.deepstack[k] for f in features) for k in range(num_layers)]
        # 5.24 reads a tuple per layer and concatenates; 5.17 reads one tensor per layer
        split = deepstack_split_per_image(handle.model)
        out.deepstack_features = [layer if split else torch.cat(layer) for layer in per_layer]
    return out
