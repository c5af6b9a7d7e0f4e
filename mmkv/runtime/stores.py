"""``TurnStores``: where one turn's cached work comes from (the KV store, the encoder store, the vision tower)
and what it leaves to store afterwards.

One object per turn. It looks images up in the stores (the planner asks), memoises the vision outputs it
fetched or computed this turn (an image seen twice in one prompt runs the tower once), and queues the turn's
store writes; ``flush`` runs them after the first token is known, so store writes (disk ones included) are not
part of the time to first token. Example::

    turn_stores = TurnStores(handle, kv_store, encoder_store, TurnPolicy(reuse="kv"))
    segment, tier = turn_stores.kv(image)           # (KVSegment, "memory") or (None, None)
    tier = turn_stores.encoder_tier(image)          # "memory" | "disk" | "computed": a lookup, no tower
    features = turn_stores.features(image)          # the memo, else the store, else the tower (write queued)
    turn_stores.flush(live, writes)                 # image KV and vision outputs into the stores

A policy whose ``reads_stores`` is false (``reuse="none"``) never reads or writes the stores; one that does not
``splices_kv`` (``"encoder"``) never looks image KV up.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..cache import EncoderStore, KVStore, image_digest
from ..cache.memory import MemoryTier
from ..cache.store import StoreTier
from ..errors import StoreMismatchError
from ..images import ImageSource, load_image
from ..kv.segment import KVSegment
from ..kv.vision import ImageFeatures, encode_images
from ..messages import ConversationImage
from ..model.handle import ModelHandle
from ..model.processor import ImageInputs
from ..policy import TurnPolicy
from .live import LiveCache
from .plan import StoreWrite

__all__ = ["TurnStores", "inputs_nbytes", "prepare_image", "preprocess"]


def preprocess(handle: ModelHandle, image: ConversationImage) -> ImageInputs:
    """The vision tower's input for ``image`` (resized, normalised, patchified)."""
    return handle.processor.preprocess_images([image.pixels])


def inputs_nbytes(inputs: ImageInputs) -> int:
    """Bytes an ``ImageInputs`` holds."""
    return inputs.pixel_values.numel() * inputs.pixel_values.element_size()


def prepare_image(
    handle: ModelHandle, source: ImageSource, max_pixels: int, policy: TurnPolicy, encoder_store: EncoderStore,
    vision_inputs: MemoryTier,
) -> ConversationImage:  # fmt: skip
    """``source`` (PIL image, path or bytes) normalised and keyed for ``handle`` (over ``max_pixels``: refused);
    unless its vision outputs are stored already (and ``policy`` reads stores), also preprocessed into ``vision_inputs``
    now, so a turn that needs the vision tower does not pay for it in its time to first token. Raises the
    ``mmkv.ImageError`` of a bad image."""
    image = load_image(source, max_pixels=max_pixels)
    processor = handle.processor
    record = ConversationImage(
        image, image_digest(image, processor, handle.fingerprint), processor.image_grid(image)
    )
    if record.digest not in vision_inputs and (
        not policy.reads_stores or not encoder_store.contains(record.digest, handle)
    ):
        inputs = preprocess(handle, record)
        vision_inputs.put(record.digest, inputs, inputs_nbytes(inputs))
    return record


class TurnStores:
    """Store and encoder lookups of one turn, their memo, and the writes queued for after the first token."""

    def __init__(
        self,
        handle: ModelHandle,
        kv_store: KVStore,
        encoder_store: EncoderStore,
        policy: TurnPolicy,
        vision_inputs: MemoryTier | None = None,
    ) -> None:
        """``policy``: the turn's (what it reads and writes); ``vision_inputs``: preprocessed vision-tower inputs by digest (made when the image was added), if any."""
        self.handle = handle
        self.vision_inputs = vision_inputs
        self.kv_store = kv_store
        self.encoder_store = encoder_store
        self.policy = policy
        self._features: dict[str, tuple[list[ImageFeatures], str]] = {}  # digest -> (features, tier)
        self._feature_puts: list[tuple[str, list[ImageFeatures]]] = []  # computed this turn, to store

    def kv(self, image: ConversationImage) -> tuple[KVSegment | None, StoreTier | None]:
        """The image's stored KV and the tier that had it, or ``(None, None)``. Raises ``StoreMismatchError`` when
        the store hands back KV this model could not have made for it."""
        if not self.policy.splices_kv:
            return None, None
        segment, tier = self.kv_store.lookup(image.digest, self.handle)
        if segment is not None:
            self._check_fits(segment)
        return segment, tier

    def encoder_tier(self, image: ConversationImage) -> str:
        """Where the image's vision outputs will come from: ``"memory"`` / ``"disk"`` (a store hit, fetched now
        into the memo) or ``"computed"`` (the tower runs when ``features`` is called)."""
        if image.digest in self._features:
            return self._features[image.digest][1]
        if self.policy.reads_stores:
            cached, tier = self.encoder_store.lookup(image.digest, self.handle)
            if cached is not None:
                self._features[image.digest] = (cached, tier)
                return tier
        return "computed"

    def features(self, image: ConversationImage) -> list[ImageFeatures]:
        """The image's vision outputs: from this turn's memo, the encoder store, or the vision tower (then
        queued for the store if the policy ``reads_stores``)."""
        self.encoder_tier(image)  # a store hit lands in the memo
        if image.digest in self._features:
            return self._features[image.digest][0]
        inputs = None if self.vision_inputs is None else self.vision_inputs.get(image.digest)
        if inputs is None:
            inputs = preprocess(self.handle, image)
        computed = encode_images(self.handle, inputs)
        self._features[image.digest] = (computed, "computed")
        if self.policy.reads_stores:
            self._feature_puts.append((image.digest, computed))
        return computed

    def flush(self, live: LiveCache, writes: Sequence[StoreWrite]) -> None:
        """Store the image KV of ``writes`` (read from ``live``, which must hold them) and the vision outputs
        computed this turn. Store failures are the stores' to count; this does not change ``live``."""
        for write in writes:
            segment = live.segment(write.start, write.start + write.length, "image", write.digest)
            self.kv_store.put(write.digest, segment, self.handle)
        for digest, features in self._feature_puts:
            self.encoder_store.put(digest, features, self.handle)
        self._feature_puts = []

    def _check_fits(self, segment: KVSegment) -> None:
        expected = self.handle.kv_shape
        found = (segment.num_layers, int(segment.keys.shape[2]), int(segment.keys.shape[-1]))
        if found != expected:
            raise StoreMismatchError(
                f"the store returned KV with (layers, kv heads, head_dim) = {found}; this model has {expected}. "
                "Use a store directory per model, or clear it"
            )
