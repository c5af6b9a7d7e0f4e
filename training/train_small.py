"""Train the small shipped checkpoints on the synthetic task suite, so the eval and the demo have models that
decide something.

The models are the real transformers classes (Qwen2.5-VL, Qwen3-VL) shrunk to a few million parameters, with a
byte-level BPE tokenizer trained on the suite's texts and the family's chat template. Prompts are rendered by an
``mmkv.Session`` (exactly as the eval and the demo render them), the loss is on the answer tokens only, and the
result is saved as a standard checkpoint directory that ``mmkv.load("small-qwen3-vl")`` loads.

Run::

    python training/train_small.py --family qwen3_vl --steps 3000          # -> checkpoints/small-qwen3-vl
    python training/train_small.py --family qwen2_5_vl --steps 3000        # -> checkpoints/small-qwen2.5-vl
    python training/train_small.py --family qwen3_vl --steps 50 --out /tmp/smoke --eval-n 10   # smoke run
    python training/train_small.py --family qwen3_vl --init checkpoints/small-qwen3-vl --out /tmp/more \
        --steps 20000 --max-minutes 120 --target 0.9 --checkpoint-every 1000 --lr 1e-3   # continue, bounded

``--max-minutes`` bounds the run in time: the cosine schedule advances by whichever of the step and the time
fraction is further along, so a time-bounded run still ends at a low learning rate. ``--target`` stops at the
first snapshot whose quick held-out estimate reaches it in every category.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script from anywhere: make the repository's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tqdm import tqdm
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import mmkv
from evals.tasks import (
    AGENTIC_POLICY,
    COLOURS,
    SHAPES,
    TRAINING_CATEGORIES,
    Sample,
    iter_samples,
    make_samples,
    normalise_answer,
    sample_session,
)
from mmkv.model.handle import FAMILIES, ModelHandle
from mmkv.model.processor import VLProcessor
from mmkv.model.templates import QWEN2_VL_TEMPLATE, QWEN3_VL_TEMPLATE
from mmkv.model.tiny import train_tokenizer

# Share of each category in a batch: the agentic tasks are learnt fastest, so the rest get more of the data.
MIX = {"perception": 0.25, "reasoning": 0.25, "trajectory": 0.25, "agentic": 0.15, "agentic_text": 0.10}
OUT_NAMES = {"qwen3_vl": "small-qwen3-vl", "qwen2_5_vl": "small-qwen2.5-vl"}


def _corpus() -> list[str]:
    """Texts the tokenizer is trained on: everything the suite and the chat template can say."""
    words = [*COLOURS, *SHAPES, "yes", "no", "first", "second", "same", "admin", "viewer"]
    lines = [AGENTIC_POLICY.format(role=r) for r in ("admin", "viewer")]
    for category in TRAINING_CATEGORIES:
        for sample in make_samples(category, 300, seed=123, split="train"):
            lines += [sample.question, sample.answer, *(t.text for t in sample.turns)]
    lines += ["system user assistant", "You are a helpful assistant.", " ".join(words)]
    lines += [f"click(approve) escalate(ticket) click(submit) fill(field) Screen {i}." for i in range(1, 7)]
    return lines


def build_model(family: str, seed: int = 0) -> ModelHandle:
    """A fresh small model of ``family`` with its tokenizer, image processor and chat template."""
    tokenizer = train_tokenizer(_corpus(), vocab_size=700)
    vocab = tokenizer.get_vocab()
    ids = {
        "image_token_id": vocab["<|image_pad|>"],
        "video_token_id": vocab["<|video_pad|>"],
        "vision_start_token_id": vocab["<|vision_start|>"],
        "vision_end_token_id": vocab["<|vision_end|>"],
    }
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": True,
    }
    vision = {
        "depth": 4,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_heads": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 128,
    }
    torch.manual_seed(seed)
    if family == "qwen3_vl":
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5]}
        vision |= {"patch_size": 16, "num_position_embeddings": 64, "deepstack_visual_indexes": [1, 3]}
        config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
        model = Qwen3VLForConditionalGeneration(config)
        image_processor = Qwen2VLImageProcessorPil(
            patch_size=16,
            merge_size=2,
            min_pixels=32 * 32 * 4,
            max_pixels=128 * 128,
            image_mean=[0.5] * 3,
            image_std=[0.5] * 3,
        )
        template = QWEN3_VL_TEMPLATE
    else:
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
        vision |= {"patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1, 3]}
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
        model = Qwen2_5_VLForConditionalGeneration(config)
        image_processor = Qwen2VLImageProcessorPil(
            patch_size=14,
            merge_size=2,
            min_pixels=28 * 28 * 4,
            max_pixels=140 * 140,
            image_mean=list(OPENAI_CLIP_MEAN),
            image_std=list(OPENAI_CLIP_STD),
        )
        template = QWEN2_VL_TEMPLATE
    processor = VLProcessor(tokenizer, image_processor, template)
    return ModelHandle.from_parts(OUT_NAMES[family], model.eval(), processor, FAMILIES[family])


def encode_example(handle: ModelHandle, sample: Sample) -> dict[str, torch.Tensor]:
    """Token ids, labels (answer only) and pixels of one training example, rendered as a Session renders it."""
    session = sample_session(handle, sample)
    prompt, order = session.render(sample.question)
    answer = torch.tensor(handle.processor.encode_text(sample.answer + "<|im_end|>"), dtype=torch.long)
    ids = torch.cat([prompt, answer])
    labels = torch.cat([torch.full_like(prompt, -100), answer])
    example = {"ids": ids, "labels": labels}
    if order:  # text-only samples (the agentic task's text gate) have no pixels
        images = handle.processor.preprocess_images([session.images[i].pixels for i in order])
        example |= {"pixel_values": images.pixel_values, "grid": images.image_grid_thw}
    return example


def collate(handle: ModelHandle, batch: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded batch inputs for the model's own forward (it computes M-RoPE positions itself)."""
    length = max(int(b["ids"].shape[0]) for b in batch)
    pad = handle.tokenizer.pad_token_id
    ids = torch.full((len(batch), length), pad, dtype=torch.long)  # (B, L)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)  # (B, L)
    mask = torch.zeros((len(batch), length), dtype=torch.long)  # (B, L)
    for row, b in enumerate(batch):
        n = int(b["ids"].shape[0])
        ids[row, :n], labels[row, :n], mask[row, :n] = b["ids"], b["labels"], 1
    inputs = {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "mm_token_type_ids": (ids == handle.processor.image_token_id).int(),
    }
    with_images = [b for b in batch if "grid" in b]
    if with_images:
        inputs["pixel_values"] = torch.cat([b["pixel_values"] for b in with_images])
        inputs["image_grid_thw"] = torch.cat([b["grid"] for b in with_images])
    return inputs


@torch.no_grad()
def heldout_accuracy(handle: ModelHandle, n: int, seed: int = 0) -> dict[str, float]:
    """Accuracy per category under full recompute (``reuse="none"``), greedy answers."""
    handle.model.eval()
    out = {}
    for category in TRAINING_CATEGORIES:
        samples = make_samples(category, n, seed=seed, split="heldout")
        correct = 0
        for sample in samples:
            answer = sample_session(handle, sample, reuse="none").ask(sample.question, max_new_tokens=8)
            correct += normalise_answer(answer.text) == normalise_answer(sample.answer)
        out[category] = correct / len(samples)
    return out


def _snapshot(
    handle: ModelHandle, out: Path, step: int, losses: list[float], eval_n: int, seconds: float
) -> dict[str, float]:
    """Mid-run checkpoint with a quick held-out estimate, appended to ``out/progress.jsonl`` (to watch a long run
    and keep something usable if it is stopped). Returns the estimate."""
    handle.model.eval()
    accuracy = heldout_accuracy(handle, eval_n)
    handle.model.train()
    snapshot = ModelHandle.from_parts(handle.name, handle.model, handle.processor, handle.family)
    snapshot.save(out)
    line = {
        "step": step,
        "seconds": round(seconds, 1),
        "loss": sum(losses[-100:]) / len(losses[-100:]),
        "heldout_quick": accuracy,
    }
    with open(out / "progress.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
    tqdm.write(json.dumps(line))
    return accuracy


def schedule_progress(step: int, steps: int, elapsed_s: float, max_seconds: float | None) -> float:
    """How far along the run is, in [0, 1]: the step fraction, or the time fraction when that is further.

    >>> schedule_progress(50, 100, 30.0, 60.0), schedule_progress(50, 100, 45.0, 60.0)
    (0.5, 0.75)
    """
    fraction = step / steps
    if max_seconds:
        fraction = max(fraction, elapsed_s / max_seconds)
    return min(1.0, fraction)


def train(
    family: str,
    steps: int,
    batch_size: int,
    lr: float,
    out: Path,
    eval_n: int,
    seed: int,
    init: Path | None = None,
    checkpoint_every: int = 0,
    *,
    device: str = "cpu",
    max_minutes: float | None = None,
    target: float | None = None,
    snapshot_n: int = 30,
) -> dict:
    """Train (from scratch, or on from the checkpoint ``init``), evaluate on the held-out split, save; returns
    the report written next to the checkpoint.

    Stops after ``steps`` steps, after ``max_minutes`` (the schedule is time-aware, see ``schedule_progress``),
    or at the first snapshot (every ``checkpoint_every`` steps) whose quick estimate on ``snapshot_n`` held-out
    samples per category reaches ``target`` in every category."""
    torch.manual_seed(seed)
    if init is None:
        handle = build_model(family, seed)
        model = handle.model.to(device)
        handle = ModelHandle.from_parts(handle.name, model, handle.processor, handle.family)
    else:
        handle = mmkv.load(init, device=device)
    model = handle.model.train()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 30)
    max_seconds = None if max_minutes is None else 60.0 * max_minutes
    clock = {"started": time.time()}
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * 0.5
            * (
                1
                + math.cos(math.pi * schedule_progress(s, steps, time.time() - clock["started"], max_seconds))
            )
        ),
    )
    previous = json.loads((init / "training_report.json").read_text()) if init is not None else {}
    streams = {
        c: iter_samples(c, seed + previous.get("total_steps", 0), "train") for c in TRAINING_CATEGORIES
    }
    categories, weights = zip(*MIX.items(), strict=True)
    rng = random.Random(seed)
    started, losses, stopped_by = time.time(), [], "steps"
    clock["started"] = started
    progress = tqdm(range(steps), desc=f"train {family}")
    done = 0
    for step in progress:
        drawn = rng.choices(categories, weights, k=batch_size)
        batch = [encode_example(handle, next(streams[c])) for c in drawn]
        inputs = {name: tensor.to(device) for name, tensor in collate(handle, batch).items()}
        loss = model(**inputs).loss
        model.model.rope_deltas = None
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 25 == 0:
            progress.set_postfix(loss=f"{sum(losses[-25:]) / len(losses[-25:]):.3f}")
        done = step + 1
        elapsed = time.time() - started
        if max_seconds is not None and elapsed >= max_seconds:
            stopped_by = "time"
            break
        if checkpoint_every and done % checkpoint_every == 0 and done < steps:
            quick = _snapshot(handle, out, done, losses, snapshot_n, elapsed)
            if target is not None and min(quick.values()) >= target:
                stopped_by = "target"
                break
    train_seconds = time.time() - started
    model.eval()
    accuracy = heldout_accuracy(handle, eval_n)
    handle = ModelHandle.from_parts(
        handle.name, model, handle.processor, handle.family
    )  # fingerprint of the result
    handle.save(out)
    report = {
        "family": family,
        "params": params,
        "steps": done,
        "stopped_by": stopped_by,  # "steps", "time" (max_minutes) or "target"
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "train_seconds": round(train_seconds, 1),
        "final_loss": sum(losses[-50:]) / len(losses[-50:]),
        "heldout_accuracy": accuracy,
        "heldout_n_per_category": eval_n,
        "weights_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
        "total_steps": previous.get("total_steps", 0) + done,  # over every --init continuation
        "total_train_seconds": round(previous.get("total_train_seconds", 0) + train_seconds, 1),
        "history": [*previous.get("history", []), {"steps": done, "lr": lr, "heldout_accuracy": accuracy}],
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    from mmkv.cli import install_error_hook

    install_error_hook("training/train_small.py")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", choices=sorted(OUT_NAMES), default="qwen3_vl")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument(
        "--eval-n", type=int, default=100, help="held-out samples per category for the report"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="default: checkpoints/<small model name>")
    parser.add_argument("--init", type=Path, default=None, help="continue training this checkpoint directory")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="save and quick-evaluate every N steps (0: only at the end)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--max-minutes", type=float, default=None, help="stop (and decay the lr) by this time"
    )
    parser.add_argument("--target", type=float, default=None, help="stop once every category reaches this")
    parser.add_argument(
        "--snapshot-n", type=int, default=30, help="held-out samples per category per snapshot"
    )
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out_dir = args.out or Path(__file__).resolve().parents[1] / "checkpoints" / OUT_NAMES[args.family]
    print(
        json.dumps(
            train(
                args.family,
                args.steps,
                args.batch_size,
                args.lr,
                out_dir,
                args.eval_n,
                args.seed,
                args.init,
                args.checkpoint_every,
                device=args.device,
                max_minutes=args.max_minutes,
                target=args.target,
                snapshot_n=args.snapshot_n,
            ),
            indent=1,
        )
    )
