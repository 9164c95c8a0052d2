"""Tiny random-weight models the real vLLM serves, built here with nothing downloaded.

    <engine venv>/bin/python -m bench.harness.realvllm.models [OUT_DIR] [--only chat,embed]

Runs in the engine venv (torch, transformers, tokenizers). Every run writes byte-identical
files: the tokenizers are trained on text generated from a fixed seed, the weights come
from a fixed seed, and the WordPiece vocabulary is renumbered in sorted order (its
trainer's ids for equally frequent tokens change between runs).

| name | architecture | what it serves |
| --- | --- | --- |
| tiny-llama | LlamaForCausalLM, 2 layers, hidden 256 | chat, completions, tokenize |
| tiny-qwen2vl | Qwen2VLForConditionalGeneration, ≤ 64 tokens an image | chat with images |
| tiny-bert-embed | BertModel + mean pooling (sentence-transformers layout) | embeddings, score |
| tiny-bert-rerank | BertForSequenceClassification, one label | score, rerank, classify |
| tiny-qwen3 | Qwen3ForCausalLM, 2 layers, hidden 256 (`yes`, `no` are tokens) | /v1/systemone |
| llama-big | LlamaForCausalLM, 10 layers, hidden 640, context 16,384 | routing on real engines |
| qwen2vl-big | Qwen2VL, llama-big's text stack, images up to 672 px (576 tokens) | same |
| llama-small | tiny-llama's stack, context 16,384 | the same, on a CPU without bfloat16 |
| qwen2vl-small | tiny-llama's stack, a one-layer vision tower, images up to 672 px | same |

The routing ones (`--only llama-big,qwen2vl-big,llama-small,qwen2vl-small`, not built by
default) share the tiny ones' tokenizer and templates; `bench routing --real-vllm` builds
the pair it runs when they are missing.

Their output is gibberish: only HTTP behaviour, routes, metrics and media matter here.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.realvllm.home import Home

SEED = 1234
BPE_VOCAB = 4096
WORDPIECE_VOCAB = 3000
MAX_LEN = 2048

CHAT = "tiny-llama"
MULTIMODAL = "tiny-qwen2vl"
EMBED = "tiny-bert-embed"
RERANK = "tiny-bert-rerank"
DECISIONS = "tiny-qwen3"
ALL = (CHAT, MULTIMODAL, EMBED, RERANK, DECISIONS)
# Big enough that a 2,048-token prefill costs hundreds of milliseconds on a CPU core, so
# that routing shows in the time to first token; built on demand (bench routing --real-vllm).
CHAT_BIG = "llama-big"
MULTIMODAL_BIG = "qwen2vl-big"
BIG = (CHAT_BIG, MULTIMODAL_BIG)
# The same prompts and images at about a twentieth of the compute: in float32 on a CPU
# without bfloat16 instructions they prefill about as fast as the big ones in bfloat16 on
# one with them (docs/facts.md).
CHAT_SMALL = "llama-small"
MULTIMODAL_SMALL = "qwen2vl-small"
SMALL = (CHAT_SMALL, MULTIMODAL_SMALL)
ROUTING = (*BIG, *SMALL)
BIG_MAX_LEN = 16384

BPE_SPECIALS = (
    "<|endoftext|>",  # padding
    "<|im_start|>",
    "<|im_end|>",  # end of turn
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<s>",  # Llama's beginning of sequence
)
WORDPIECE_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# Which special token plays which part (tokenizer keyword arguments).
BPE_ROLES = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
LLAMA_ROLES = {"bos_token": "<s>"}
WORDPIECE_ROLES = {
    "unk_token": "[UNK]",
    "sep_token": "[SEP]",
    "pad_token": "[PAD]",
    "cls_token": "[CLS]",
    "mask_token": "[MASK]",
}

_SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
_TURN = "<|im_start|>{{ message['role'] }}\n"
_GENERATION = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def _chatml(part: str) -> str:
    """A ChatML template (a default system prompt when none is given) that renders each
    part of a list content with `part`, a Jinja fragment over `part`."""
    return (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        + _SYSTEM
        + "{% endif %}"
        + _TURN
        + "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        + part
        + "{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}" + _GENERATION
    )


# ChatML; text parts only.
CHAT_TEMPLATE = _chatml("{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}")

# Qwen2-VL's layout: each image becomes <|vision_start|><|image_pad|><|vision_end|> and
# the processor expands the pad to the image's tokens.
MULTIMODAL_TEMPLATE = _chatml(
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}"
    "{% endif %}"
)

# The training text: sentences drawn from these words with a fixed seed. English words,
# so that test prompts written in English tokenize into words, not bytes.
_WORD_TEXT = (
    "the a an of to in on at for with from by about as into over after before under "
    "and or but if then because while when where which who what how why this that these "
    "those it its they them their we our you your he she his her is are was were be been "
    "has have had do does did can could will would should may might must not no yes all "
    "some any each every many much more most few less other same new old first last long "
    "short big small large little high low good bad right left next early late real true "
    "image picture photo colour red green blue white black yellow square circle line dot "
    "model engine gateway request response token prompt cache prefix block route key "
    "server client stream chunk error status header metric count time second minute hour "
    "day week year number one two three four five six seven eight nine ten hundred "
    "question answer document query score rank label class text word sentence page book "
    "city river mountain sea tree flower garden house room door window table chair road "
    "car train ship plane bird fish dog cat horse cow water fire air earth light sound "
    "system assistant user tool message content conversation turn reply summary topic "
    "describe explain compare list show tell give take make find keep send read write "
    "open close start stop run walk see look hear feel think know want need use try"
)
WORDS = tuple(_WORD_TEXT.split())


# /v1/systemone reads each label (A-Z, yes/no, 0-9) as the reply's one first token after
# the generation prompt (`reply_label_ids` in
# vllm/entrypoints/generate/structured_decisions/strategies.py), and the corpus has `yes`
# and `no` only after a space: these lines make them tokens of their own.
DECISION_LINES = ("yes", "no") * 50


def corpus(sentences: int = 6000, seed: int = SEED) -> list[str]:
    """Deterministic training text: the same lines on every machine and every run."""
    rng = random.Random(seed)
    digits = "0123456789"
    lines = []
    for _ in range(sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 18))]
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), "".join(rng.choices(digits, k=4)))
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + rng.choice(".?!,;:"))
    return lines


def seed_everything() -> None:
    import numpy
    import torch

    random.seed(SEED)
    numpy.random.seed(SEED)
    torch.manual_seed(SEED)


def padded(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# --- tokenizers ------------------------------------------------------------------------


def train_bpe(extra: Sequence[str] = ()) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=list(BPE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*corpus(), *extra], trainer)
    return tok


def bpe_tokenizer(tok: Any, template: str, **extra: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        **BPE_ROLES,
        model_max_length=MAX_LEN,
        clean_up_tokenization_spaces=False,
        **extra,
    )
    wrapped.chat_template = template
    return wrapped


def train_wordpiece() -> Any:
    """A WordPiece vocabulary counted from the corpus: the specials, every character alone
    and as a `##` continuation, then the words seen twice or more, most frequent first.
    (The tokenizers library's trainer picks among equally frequent pieces in hash-map
    order, so its vocabulary changes from run to run.)"""
    from tokenizers import BertWordPieceTokenizer, processors

    counts = Counter(
        piece for line in corpus() for piece in re.findall(r"\w+|[^\w\s]", line.lower())
    )
    chars = sorted({c for piece in counts for c in piece})
    words = sorted(
        (w for w, n in counts.items() if n >= 2 and len(w) > 1), key=lambda w: (-counts[w], w)
    )
    vocab = [*WORDPIECE_SPECIALS, *chars, *(f"##{c}" for c in chars), *words]
    vocab = vocab[:WORDPIECE_VOCAB]
    tok = BertWordPieceTokenizer({token: i for i, token in enumerate(vocab)}, lowercase=True)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    # BERT framing, [CLS] A [SEP] B [SEP] with segment ids, which a vocabulary built from
    # scratch does not get by itself; the cross-encoder scores pairs with it.
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tok


def bert_tokenizer(tok: Any) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok._tokenizer,
        **WORDPIECE_ROLES,
        model_max_length=512,
        clean_up_tokenization_spaces=True,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def save_template(out: Path, template: str) -> None:
    """transformers writes the template to chat_template.jinja; older readers look in
    tokenizer_config.json only."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    write_json(path, config)


def save_generation_config(out: Path, eos: list[int], pad: int, bos: int) -> None:
    from transformers import GenerationConfig

    GenerationConfig(
        eos_token_id=eos, pad_token_id=pad, bos_token_id=bos, do_sample=True, temperature=1.0
    ).save_pretrained(out)


# --- models ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    """The dimensions of a BPE model: its text stack (head size 64, 2 KV heads), its
    context, and for Qwen2-VL its vision tower and the images' range of sides in pixels."""

    hidden: int = 256
    mlp: int = 512
    layers: int = 2
    context: int = MAX_LEN
    multimodal_context: int = 4096
    vision_depth: int = 2
    vision_embed: int = 64
    vision_heads: int = 2
    min_side: int = 56
    max_side: int = 224


TINY = Size()
# 47.7M parameters (llama-big), 51.8M (qwen2vl-big): images of 112 to 672 px a side,
# 16 to 576 tokens, enough to span whole 128-token KV blocks on the CPU backend.
BIG_SIZE = Size(
    hidden=640,
    mlp=1792,
    layers=10,
    context=BIG_MAX_LEN,
    multimodal_context=BIG_MAX_LEN,
    vision_depth=4,
    vision_embed=256,
    vision_heads=4,
    min_side=112,
    max_side=672,
)
# 2.6M parameters (llama-small), 2.8M (qwen2vl-small); the images and context of BIG_SIZE.
SMALL_SIZE = Size(
    context=BIG_MAX_LEN,
    multimodal_context=BIG_MAX_LEN,
    vision_depth=1,
    min_side=112,
    max_side=672,
)


def _sized_tokenizer(bpe: Any, template: str, size: Size, **extra: str) -> Any:
    tok = bpe_tokenizer(bpe, template, **extra)
    if size.context != MAX_LEN:
        tok.model_max_length = size.context
    return tok


def build_chat(out: Path, bpe: Any, size: Size = TINY) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    seed_everything()
    tok = _sized_tokenizer(bpe, CHAT_TEMPLATE, size, **LLAMA_ROLES)
    ids = {t: tok.convert_tokens_to_ids(t) for t in BPE_SPECIALS}
    config = LlamaConfig(
        vocab_size=padded(len(tok)),
        hidden_size=size.hidden,
        intermediate_size=size.mlp,
        num_hidden_layers=size.layers,
        num_attention_heads=size.hidden // 64,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=size.context,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=ids["<s>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    config.architectures = ["LlamaForCausalLM"]
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    save_template(out, CHAT_TEMPLATE)
    save_generation_config(out, config.eos_token_id, config.pad_token_id, config.bos_token_id)


def build_multimodal(out: Path, bpe: Any, size: Size = TINY) -> None:
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    seed_everything()
    tok = _sized_tokenizer(bpe, MULTIMODAL_TEMPLATE, size)
    ids = {t: tok.convert_tokens_to_ids(t) for t in BPE_SPECIALS}
    text = {
        "vocab_size": padded(len(tok)),
        "hidden_size": size.hidden,
        "intermediate_size": size.mlp,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.hidden // 64,
        "num_key_value_heads": 2,
        "max_position_embeddings": size.multimodal_context,
        "rms_norm_eps": 1e-6,
        # Head size 64: the multimodal rope sections add up to half of it.
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [8, 12, 12],
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": False,
    }
    vision = {
        "depth": size.vision_depth,
        "embed_dim": size.vision_embed,
        "hidden_size": size.hidden,  # the patch merger's output: the text model's hidden size
        "hidden_act": "quick_gelu",
        "mlp_ratio": 2,
        "num_heads": size.vision_heads,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    config.dtype = "float32"
    Qwen2VLForConditionalGeneration(config).save_pretrained(out, safe_serialization=True)
    # Images of min_side^2 to max_side^2 pixels (tiny: 56 to 224 px a side, 64 tokens at most).
    sizes = {
        "size": {
            "shortest_edge": size.min_side * size.min_side,
            "longest_edge": size.max_side * size.max_side,
        },
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**sizes),
        video_processor=Qwen2VLVideoProcessor(**sizes),
        tokenizer=tok,
        chat_template=MULTIMODAL_TEMPLATE,
    )
    processor.save_pretrained(out)
    tok.save_pretrained(out)
    save_template(out, MULTIMODAL_TEMPLATE)
    end = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    save_generation_config(out, end, ids["<|endoftext|>"], ids["<|endoftext|>"])


def build_decisions(out: Path, bpe: Any) -> None:
    """A Qwen3, the one small text architecture vLLM 0.32 serves /v1/systemone for
    (`READ_STRATEGIES` in vllm/entrypoints/generate/structured_decisions/strategies.py)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    seed_everything()
    tok = bpe_tokenizer(bpe, CHAT_TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in BPE_SPECIALS}
    config = Qwen3Config(
        vocab_size=padded(len(tok)),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=MAX_LEN,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    config.architectures = ["Qwen3ForCausalLM"]
    Qwen3ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    save_template(out, CHAT_TEMPLATE)
    save_generation_config(out, config.eos_token_id, config.pad_token_id, config.bos_token_id)


def bert_config(vocab: int, **extra: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=padded(vocab),
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=512,
        type_vocab_size=2,
        pad_token_id=0,
        **extra,
    )


def build_embed(out: Path, wordpiece: Any) -> None:
    from transformers import BertModel

    seed_everything()
    tok = bert_tokenizer(wordpiece)
    config = bert_config(len(tok))
    config.architectures = ["BertModel"]
    BertModel(config, add_pooling_layer=False).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    # The sentence-transformers layout tells vLLM to mean-pool and normalize.
    modules = [
        ("0", "", "Transformer"),
        ("1", "1_Pooling", "Pooling"),
        ("2", "2_Normalize", "Normalize"),
    ]
    write_json(
        out / "modules.json",
        [
            {"idx": i, "name": name, "path": path, "type": f"sentence_transformers.models.{kind}"}
            for i, (name, path, kind) in enumerate(modules)
        ],
    )
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "2_Normalize").mkdir(exist_ok=True)
    write_json(
        out / "1_Pooling" / "config.json",
        {
            "word_embedding_dimension": 128,
            "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": True,
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
        },
    )
    write_json(out / "sentence_bert_config.json", {"max_seq_length": 512, "do_lower_case": True})


def build_rerank(out: Path, wordpiece: Any) -> None:
    from transformers import BertForSequenceClassification

    seed_everything()
    tok = bert_tokenizer(wordpiece)
    config = bert_config(len(tok), num_labels=1, id2label={0: "LABEL_0"}, label2id={"LABEL_0": 0})
    config.architectures = ["BertForSequenceClassification"]
    BertForSequenceClassification(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def build(out_dir: Path, names: Sequence[str] = ALL) -> list[Path]:
    """Build the named models under `out_dir`, each written to a temporary folder first
    and renamed into place, so an interrupted build never leaves half a model."""
    import torch

    torch.set_num_threads(1)
    out_dir.mkdir(parents=True, exist_ok=True)
    bpe = train_bpe() if {CHAT, MULTIMODAL, *ROUTING} & set(names) else None
    decisions_bpe = train_bpe(DECISION_LINES) if DECISIONS in names else None
    wordpiece = train_wordpiece() if {EMBED, RERANK} & set(names) else None
    builders: dict[str, Callable[[Path], None]] = {
        CHAT: lambda out: build_chat(out, bpe),
        MULTIMODAL: lambda out: build_multimodal(out, bpe),
        EMBED: lambda out: build_embed(out, wordpiece),
        RERANK: lambda out: build_rerank(out, wordpiece),
        DECISIONS: lambda out: build_decisions(out, decisions_bpe),
        CHAT_BIG: lambda out: build_chat(out, bpe, BIG_SIZE),
        MULTIMODAL_BIG: lambda out: build_multimodal(out, bpe, BIG_SIZE),
        CHAT_SMALL: lambda out: build_chat(out, bpe, SMALL_SIZE),
        MULTIMODAL_SMALL: lambda out: build_multimodal(out, bpe, SMALL_SIZE),
    }
    built = []
    for name in names:
        target = out_dir / name
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out_dir))
        builders[name](staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
        built.append(target)
    return built


def files(model_dir: Path) -> Iterator[Path]:
    return (p for p in sorted(model_dir.rglob("*")) if p.is_file())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.harness.realvllm.models", description=__doc__)
    p.add_argument("out_dir", nargs="?", type=Path, default=Home.default().models)
    p.add_argument(
        "--only",
        default=",".join(ALL),
        help=f"comma-separated model names (default: the tiny ones; also {', '.join(ROUTING)})",
    )
    a = p.parse_args(argv)
    names = [n for n in a.only.split(",") if n]
    unknown = sorted(set(names) - {*ALL, *ROUTING})
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {[*ALL, *ROUTING]}")
    for path in build(a.out_dir, names):
        size = sum(f.stat().st_size for f in files(path))
        print(f"{path} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
