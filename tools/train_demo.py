"""Train the bundled demo checkpoint: a tiny Llama that completes Python, trained on the stdlib's own source.

    python -m tools.train_demo --out checkpoints/demo

Runs on one CPU thread in about a quarter of an hour and is deterministic given --seed. CI never runs it;
the result is committed under checkpoints/demo/ (see checkpoints/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from checkpoints import DEMO_MODEL_DIR

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]  # ids 0, 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data", "__pycache__"}
MAX_FILE_BYTES = 200_000
SAMPLE_PROMPTS = ("def __init__(self", "import os\n", "class Stack:\n    def push(self, item):\n")


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of one training run; the defaults are what built checkpoints/demo."""

    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 688
    max_position_embeddings: int = 1024
    seq_len: int = 256
    batch_size: int = 4
    micro_batch_size: int = 4
    steps: int = 1200
    warmup_steps: int = 40
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    val_fraction: float = 0.02
    log_every: int = 50


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Stdlib *.py files in sorted order, without tests, vendored packages, codec tables and huge files."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in SKIP_DIRS or p.startswith("test") for p in parts):
            continue
        if path.stat().st_size <= MAX_FILE_BYTES:
            files.append(path)
    return files


def read_texts(files: Sequence[Path]) -> list[str]:
    """File contents as text; undecodable files are skipped."""
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style, no prefix space) with ChatML special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        model_input_names=["input_ids", "attention_mask"],
    )


def encode_corpus(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str]) -> torch.Tensor:
    """One token stream: each file preceded by <|endoftext|>."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids.append(eos)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


def unigram_entropy(data: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of the best context-free model: the loss to beat."""
    p = torch.bincount(data, minlength=vocab_size).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def build_model(cfg: TrainConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A small Llama with grouped-query attention and tied embeddings."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def sample_batch(data: torch.Tensor, n: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """n random windows of seq_len tokens."""
    starts = torch.randint(0, len(data) - seq_len, (n,), generator=gen)
    return torch.stack([data[s : s + seq_len] for s in starts.tolist()])


def make_optimizer(model: LlamaForCausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def train_step(model: LlamaForCausalLM, batch: torch.Tensor, cfg: TrainConfig) -> float:
    """Forward/backward over micro-batches (gradient accumulation); returns the mean loss."""
    chunks = batch.split(cfg.micro_batch_size)
    total = 0.0
    for chunk in chunks:
        loss = model(input_ids=chunk, labels=chunk).loss / len(chunks)
        loss.backward()
        total += loss.item()
    return total


def train(model: LlamaForCausalLM, data: torch.Tensor, cfg: TrainConfig) -> list[float]:
    """The training loop; returns the loss of every step."""
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = make_optimizer(model, cfg)
    model.train()
    losses: list[float] = []
    start = time.time()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        losses.append(train_step(model, sample_batch(data, cfg.batch_size, cfg.seq_len, gen), cfg))
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % cfg.log_every == 0 or step == 0:
            recent = sum(losses[-cfg.log_every :]) / len(losses[-cfg.log_every :])
            print(f"step {step + 1:4d}/{cfg.steps}  loss {recent:.3f}  lr {lr_at(step, cfg):.2e}  "
                  f"{time.time() - start:6.0f}s", flush=True)
    return losses


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, data: torch.Tensor, cfg: TrainConfig) -> float:
    """Mean loss over consecutive non-overlapping windows of the held-out stream."""
    model.eval()
    n = len(data) // cfg.seq_len
    windows = data[: n * cfg.seq_len].view(n, cfg.seq_len)
    losses = [model(input_ids=w, labels=w).loss.item() for w in windows.split(cfg.micro_batch_size)]
    return sum(losses) / len(losses)


@torch.no_grad()
def complete(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompt: str, n: int = 48) -> str:
    """Greedy completion of prompt (the returned text excludes the prompt)."""
    model.eval()
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=False)


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Model in bfloat16 safetensors, generation config, and tokenizer with the chat template inline."""
    out.mkdir(parents=True, exist_ok=True)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    model.generation_config = GenerationConfig(
        bos_token_id=eos, eos_token_id=[eos, im_end], pad_token_id=eos, do_sample=False, max_new_tokens=128
    )
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    _portable_tokenizer_config(out / "tokenizer_config.json")
    for path in out.iterdir():
        path.chmod(0o644)


def _portable_tokenizer_config(path: Path) -> None:
    # transformers 5 writes its own class name and a list under extra_special_tokens; transformers 4.x
    # wants PreTrainedTokenizerFast and additional_special_tokens. Both versions read the latter.
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        cfg["additional_special_tokens"] = extra
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def parse_args(argv: Sequence[str] | None = None) -> tuple[Path, TrainConfig]:
    """The output directory and the run's TrainConfig (defaults overridable from the command line)."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--out", type=Path, default=DEMO_MODEL_DIR)
    for name in ("steps", "seed", "batch_size", "micro_batch_size", "seq_len", "lr", "warmup_steps"):
        default = getattr(TrainConfig, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = vars(parser.parse_args(argv))
    return args.pop("out"), TrainConfig(**args)


def seed_everything(seed: int) -> None:
    """Fixed seeds, one CPU thread and deterministic kernels: the same seed gives the same files."""
    random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def main(argv: Sequence[str] | None = None) -> None:
    """Collect text, train tokenizer and model, save the checkpoint, print sample completions."""
    out, cfg = parse_args(argv)
    seed_everything(cfg.seed)
    t0 = time.time()
    files = stdlib_files()
    texts = read_texts(files)
    print(f"corpus: {len(texts)} files, {sum(map(len, texts)) / 1e6:.1f}M chars", flush=True)
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    data = encode_corpus(tokenizer, texts)
    n_val = int(len(data) * cfg.val_fraction)
    train_data, val_data = data[:-n_val], data[-n_val:]
    unigram = unigram_entropy(train_data, len(tokenizer))
    print(f"tokenizer: vocab {len(tokenizer)}; {len(train_data)} train / {len(val_data)} val tokens; "
          f"unigram entropy {unigram:.3f} nats ({time.time() - t0:.0f}s)")
    model = build_model(cfg, tokenizer)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
    losses = train(model, train_data, cfg)
    tail = losses[-20:]
    print(f"final train loss (last {len(tail)} steps) {sum(tail) / len(tail):.3f}; "
          f"val loss {evaluate(model, val_data, cfg):.3f}; wall {time.time() - t0:.0f}s")
    save(model, tokenizer, out)
    for prompt in SAMPLE_PROMPTS:
        print(f"--- {prompt!r}\n{prompt}{complete(model, tokenizer, prompt)}")


if __name__ == "__main__":
    main()
